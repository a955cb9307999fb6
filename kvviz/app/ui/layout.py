"""The page's own CSS: laid out for a classroom projector (1024x768, often at 125 % browser
zoom, which leaves an 819x614 CSS-pixel window), measured by tests/test_e2e_projector.py.

Why each rule: the first chart must be on the first screen, so the top of the page is tight
(less padding, the step slider's label and min/max hidden: its value shows on the thumb;
below 900 px a narrower sidebar, smaller title, tighter buttons); a row of buttons wraps to
a second line instead of cutting its labels ("p… J"); the header holding the collapsed
sidebar's "»" is drawn over the page's top, so the title moves below it; small tables
(st.table) wrap their headers and tighten their cells instead of running off the right edge.
The guided experiments head the sidebar (app.py), beside the chart they explain.
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
    ".st-key-nav button{padding-left:.5rem;padding-right:.5rem}"
    f"{ROW}{{column-gap:.4rem}}"
    "[data-testid='stTable'] th,[data-testid='stTable'] td{padding:.2rem .3rem;"
    "font-size:.8rem}}"
    "[data-testid='stTable'] th{white-space:normal;overflow-wrap:anywhere}"
    # the sidebar collapsed: the header, with its expand control, is drawn over the top
    ".stApp:has([data-testid='stExpandSidebarButton']) "
    f"{MAIN}{{padding-top:3.9rem}}"
    # a button too narrow for its label wraps it rather than cut it with an ellipsis
    "button [data-testid='stMarkdownContainer'] p{white-space:normal;overflow:visible;"
    "text-overflow:clip}"
    # a column holding only a button (the experiment's ✕) is as wide as the button
    "[data-testid='stSidebar'] [data-testid='stColumn']:has(button)"
    "{min-width:max-content!important}"
    # the step slider's min/max labels under its track (shown on hover) take a line
    ".st-key-nav [data-testid='stSliderTickBar']{display:none}"
    # the step navigator's buttons: as wide as their labels, wrapping as a row
    f"{ROW}{{flex-wrap:wrap;row-gap:.4rem}}"
    f"{ROW}>[data-testid='stColumn']{{flex:1 0 auto!important;width:auto!important;"
    "min-width:max-content!important}"
    f"{ROW}>[data-testid='stColumn']:has([data-testid='stSelectbox'])"
    "{flex:0 0 5.5rem!important;min-width:5.5rem!important}"
)

# Presentation mode (kvviz.app.ui.present; measured by tests/test_e2e_present.py at 1024x768 and
# 150 % zoom): the page's title gives its line to the way back, at the top right (the keys
# are said under the view and in its help); every text is at
# least 18 CSS px (a projected room's back row); a view's own settings (zoom, the compared
# policies, the positions typed in ...) keep their values but are not shown: the lecturer
# leaves presentation to change them, and the chart comes first on the screen. The arrows'
# buttons only hold their keys. The loop view's own step slider stays: it is its navigator.
ROOM = "[class*='st-key-room-']"
HIDDEN = ("stButtonGroup", "stMultiSelect", "stNumberInput", "stSelectbox", "stRadio",
          "stExpander", "stButton", "stCheckbox", "stToggle", "stTextInput", "stDownloadButton",
          "stPopover", "stFileUploader", "stCaptionContainer")
# The top of the page is one compact row (kvviz.app.ui.present.bar): the lesson's scene, the
# class, the step navigation, the ask buttons and the way back, wrapping at 125 % zoom; the
# header (Streamlit's menu) is not drawn over it. The keys of the buttons not shown (the arrows,
# the jumps) still work: a hidden button keeps its shortcut.
TOP = "10.75rem"  # the row, the status line and their gaps: what the fitted chart leaves above it
# views drawn without the status line (their own steps, or none)
TOPS = {"loop": "7.5rem", "needle": "8.5rem", "heads": "7.5rem"}
FIT_FALLBACK = 420  # px: the fitted chart's container before the CSS sizes it
FIT = "div:has(> .st-key-kv-fit)"


def fit_css(view: str = "") -> str:
    """The fitted chart's box: the window's height less the top rows above `view` (never
    under 16rem); the chart stretches to it."""
    h = f"max(16rem,calc(100vh - {TOPS.get(view, TOP)}))"
    return f"{FIT}{{flex:0 0 {h}!important;height:{h}!important;max-height:none!important}}"


PRESENT_CSS = (
    "h4#kvviz-watch-kv-cache-eviction-policies-decide-step-by-step{display:none}"
    "[data-testid='stHeader']{display:none}"
    f"{MAIN}{{padding-top:.8rem}}"
    ".st-key-nav-arrows,.st-key-nav-jumps{display:none}"
    ".st-key-kv-top{row-gap:.3rem}"
    ".st-key-kv-top [data-testid='stElementContainer']:has([data-testid='stSlider'])"
    "{flex:1 1 9rem;min-width:9rem}"
    ".st-key-kv-top button{min-height:2.2rem;padding:.1rem .55rem}"
    ".st-key-kv-top [data-testid='stMarkdownContainer'] p{margin:0;white-space:nowrap}"
    ".st-key-kv-top [data-testid='stMarkdownContainer'] code{white-space:nowrap}"
    ".st-key-kv-top>[data-testid='stElementContainer']:not(:has([data-testid='stSlider']))"
    "{flex:0 0 auto;width:auto!important;max-width:100%}"
    ".st-key-kv-top>[data-testid='stElementContainer']>*{width:auto!important}"
    # a timer fragment's place (the class's live count) as wide as its line; an empty one none
    ".st-key-kv-top>div:not([data-testid='stElementContainer'])"
    "{flex:0 0 auto!important;width:auto!important;min-width:0!important}"
    ".st-key-kv-top>div:not([data-testid='stElementContainer'])"
    ":not(:has([data-testid='stElementContainer'])):not(:has([data-testid='stPopover']))"
    "{display:none}"
    + "".join(f"{ROOM} [data-testid='{t}']," for t in HIDDEN)
    + f"{ROOM}:not(.st-key-room-loop) [data-testid='stSlider']{{display:none}}"
    # the view's other charts behind one control (kvviz.app.ui.present.more), and the captions
    # a scene's text reads (kvviz.app.ui.present.said): shown
    f"{ROOM} .st-key-kv-more,{ROOM} .st-key-kv-more [data-testid='stExpander']"
    "{display:block!important}"
    f"{ROOM} .st-key-kv-more [data-testid='stExpanderIcon']{{font-size:1.15rem}}"
    f"{ROOM} [class*='st-key-kv-said-'] [data-testid='stCaptionContainer']"
    "{display:block!important}"
    f"{MAIN} [data-testid='stMarkdownContainer'] p,{MAIN} [data-testid='stMarkdownContainer'] li"
    "{font-size:1.15rem;line-height:1.4}"
    f"{MAIN} [data-testid='stCaptionContainer'] p{{font-size:1.15rem}}"
    f"{MAIN} button p{{font-size:1.15rem}}"
    f"{MAIN} h3{{font-size:1.6rem}}"
    "[data-testid='stTable'] th,[data-testid='stTable'] td{font-size:1.15rem!important}"
    "[data-testid='stSliderThumbValue']{font-size:1.15rem}"
    "[data-testid='stAlert'] p{font-size:1.15rem}"
    f"{MAIN} kbd,{MAIN} [data-testid='stSelectbox'] input,{MAIN} [data-testid='stSelectbox'] div"
    "{font-size:1.15rem}"
    # the glossary is a control too: the status line takes the whole row
    f"{MAIN} [data-testid='stColumn']:has([data-testid='stPopover']){{display:none}}"
    f"{MAIN} [data-testid='stHorizontalBlock']:has([data-testid='stPopover'])>"
    "[data-testid='stColumn']{flex:1 1 100%!important;width:100%!important;max-width:100%}"
    # the first screen's lines: tighter gaps between the navigator's rows and the chart
    f"{MAIN} [data-testid='stVerticalBlock']{{row-gap:.6rem}}"
    # 125 % zoom: the row on one line, for the chart's height; the step buttons' keys (J, K,
    # the arrows) still work, the slider is narrower
    "@media (max-width:900px){"
    ".st-key-kv-top .st-key-nav-prev,.st-key-kv-top .st-key-nav-next{display:none}"
    ".st-key-kv-top [data-testid='stElementContainer']:has([data-testid='stSlider'])"
    "{flex:1 1 6rem;min-width:6rem}}"
)
