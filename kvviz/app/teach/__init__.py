"""Teaching: the class a lecturer leads on one server (classroom) and lessons (lesson).

Pure Python, no Streamlit: the page (kvviz.app.ui) holds one Registry per server process and
draws what it says; the tests drive it directly.
"""
