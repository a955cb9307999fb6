"""The page's own CSS: laid out for a classroom projector (1024x768, often at 125 % browser
zoom, which leaves an 819x614 CSS-pixel window), measured by tests/test_e2e_projector.py.

Why each rule: the first chart must be on the first screen, so the top of the page is tight
(less padding, the step slider's label hidden: its value shows on the thumb; below 900 px
a narrower sidebar, smaller title and tighter view buttons); a row of buttons wraps to a
second line instead of cutting its labels ("p… J"); the collapsed sidebar's "»" sits over
the top-left corner, so the title moves right of it; an experiment's explanation scrolls
inside a box of a few lines; small tables (st.table) wrap their headers and tighten
their cells instead of running off the right edge.
"""
TITLE = "kvviz: watch KV-cache eviction policies decide, step by step"

MAIN = "[data-testid='stMainBlockContainer']"
ROW = ".st-key-nav [data-testid='stHorizontalBlock']"
CSS = (
    f"{MAIN}{{padding-top:1.6rem;padding-bottom:2rem}}"
    f"{MAIN} h4{{padding-top:0;padding-bottom:.4rem}}"
    # below 1280 px the main column gets its side padding back
    f"@media (max-width:1280px){{{MAIN}{{padding-left:1.2rem;padding-right:1.2rem}}}}"
    # 125 % zoom at 1024x768: 819 CSS pixels across
    "@media (max-width:900px){"
    "[data-testid='stSidebar']{width:15rem!important;min-width:15rem!important}"
    f"{MAIN} h4{{font-size:1rem}}"
    f"{MAIN} [data-testid='stButtonGroup'] button{{padding:.2rem .55rem;min-height:2rem}}"
    ".st-key-exp-box{max-height:6.5rem}"
    "[data-testid='stTable'] th,[data-testid='stTable'] td{padding:.2rem .3rem;"
    "font-size:.8rem}}"
    ".st-key-exp-box{max-height:9.5rem;overflow-y:auto}"
    "[data-testid='stTable'] th{white-space:normal;overflow-wrap:anywhere}"
    # the sidebar collapsed: its expand control is over the title's first letters
    ".stApp:has([data-testid='stSidebar'][aria-expanded='false']) "
    f"{MAIN} h4{{padding-left:2.6rem}}"
    # the step navigator's buttons: as wide as their labels, wrapping as a row
    f"{ROW}{{flex-wrap:wrap;row-gap:.4rem}}"
    f"{ROW}>[data-testid='stColumn']{{flex:1 0 auto!important;width:auto!important;"
    "min-width:max-content!important}"
    f"{ROW}>[data-testid='stColumn']:has([data-testid='stSelectbox'])"
    "{flex:0 0 5.5rem!important;min-width:5.5rem!important}"
)
