"""Teaching: the class a lecturer leads (classroom), kept in a store that every process of
the server shares (store), and lessons (lesson).

Pure Python, no Streamlit: the page (kvviz.app.ui) holds one Registry per server process and
draws what it says; the tests drive it directly.
"""
