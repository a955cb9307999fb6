"""The predict-then-reveal figures (kvviz.app.figures.votes): the guesses' bars are the tally, the
answer is marked only once revealed, and the held slots carry no score."""
import re

from kvviz.app.figures.votes import ANSWER_COLOUR, GUESS_COLOUR, held_figure, votes_figure
from kvviz.app.teach.classroom import Round


def bars(fig):
    bar = fig.data[0]
    return dict(zip(map(int, bar.x), bar.y)), dict(zip(map(int, bar.x), bar.marker.color))


def round_with(votes, answer=(5,), revealed=False):
    r = Round(1, 9, "a", "tova", frozenset({0, 3, 5, 8, 9}), frozenset(answer), 9)
    r.votes.update(votes)
    r.revealed = revealed
    return r


def test_bar_heights_are_the_tally_and_nothing_is_marked_before_the_reveal():
    votes = {"s1": 5, "s2": 3, "s3": 3, "s4": 8, "s5": 3}
    r = round_with(votes)
    heights, colours = bars(votes_figure(r))
    assert heights == {3: 3, 5: 1, 8: 1} == dict(r.tally())
    assert set(colours.values()) == {GUESS_COLOUR}
    assert "answer" not in votes_figure(r).data[0].text
    title = votes_figure(r).layout.title.text
    assert "5 votes" in title and "right" not in title and "%" not in title


def test_revealed_answer_is_marked_even_with_no_vote_and_the_title_says_the_share():
    r = round_with({"s1": 3, "s2": 3, "s3": 5}, answer=(5, 9), revealed=True)
    fig = votes_figure(r)
    heights, colours = bars(fig)
    assert heights == {3: 2, 5: 1, 9: 0}
    assert colours == {3: GUESS_COLOUR, 5: ANSWER_COLOUR, 9: ANSWER_COLOUR}
    assert list(fig.data[0].text) == ["", "answer", "answer"]
    n, right, pct = re.search(r"(\d+) votes?, (\d+) right \((\d+)%\)", fig.layout.title.text).groups()
    assert (int(n), int(right)) == (3, r.right) and int(pct) == round(100 * r.share_right)


def test_one_vote_is_singular_and_no_vote_draws_an_empty_chart():
    assert re.search(r"\b1 vote\b(?!s)", votes_figure(round_with({"s1": 0})).layout.title.text)
    empty = votes_figure(round_with({}, revealed=True))
    assert "0 votes" in empty.layout.title.text and bars(empty)[0] == {5: 0}


def test_held_slots_have_one_equal_bar_each_and_no_scores():
    fig = held_figure([9, 0, 5], 9, "tova", "b", tokens=["a", "b", "c", "d", "e", "f", "g", "h",
                                                          "i", " j"])
    assert len(fig.data) == 1
    bar = fig.data[0]
    assert list(bar.x) == [9, 0, 5] and set(bar.y) == {1}
    assert list(bar.customdata) == ["·j", "a", "f"]  # tokens for the hover, nothing else
    assert "3 positions" in fig.layout.title.text and "step 9" in fig.layout.title.text

