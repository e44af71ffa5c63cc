"""Copies from the request's own text (domino.lookup): the indexed lookup must find exactly what a scan of
the text finds, and a round's copy run must go on copying the tokens after its source."""

from hypothesis import given, settings
from hypothesis import strategies as st

from domino.lookup import FIRST_COPY_CONFIDENCE, NEXT_COPY_CONFIDENCE, CopyRun, TokenHistory


def scanned_source(tokens: list[int], drafted: list[int], max_n: int, min_n: int) -> tuple[int, int] | None:
    """The reference: scan the committed tokens for the longest suffix of tokens + drafted (min_n <= n <=
    max_n) ending before the suffix itself; the latest such occurrence wins; the index after it, and n."""
    text = tokens + drafted
    for n in range(min(max_n, len(text)), min_n - 1, -1):
        suffix = text[-n:]
        ends = [e for e in range(n - 1, min(len(tokens), len(text) - 1)) if text[e - n + 1:e + 1] == suffix]
        if ends:
            return max(ends) + 1, n
    return None


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), min_size=1, max_size=40),
       drafted=st.lists(st.integers(0, 4), max_size=6), max_n=st.integers(1, 4), min_n=st.integers(1, 4))
def test_indexed_lookup_equals_a_scan_of_the_text(tokens, drafted, max_n, min_n):
    history = TokenHistory(max_n, min_n=min_n)
    for i in range(0, len(tokens), 7):  # grown in pieces, as commits grow it, looked up after some of them
        history.extend(tokens[i:i + 7])
        if i % 14:
            assert history.source(drafted) == scanned_source(tokens[:i + 7], drafted, max_n, min_n)
    assert history.source(drafted) == scanned_source(tokens, drafted, max_n, min_n)


def test_longest_match_wins_over_a_later_shorter_one():
    #          0  1  2  3  4  5  6  7  8
    history = TokenHistory(3, [5, 6, 7, 1, 6, 2, 9, 5, 6])
    assert history.source([]) == (2, 2)  # "5 6" occurred at 0-1 (followed by 7); "6" alone last at 4
    assert TokenHistory(1, history.tokens).source([]) == (5, 1)  # with single tokens only: after the 6 at 4
    assert TokenHistory(3, history.tokens, min_n=3).source([]) is None  # "9 5 6" never occurred before


def test_a_copy_run_goes_on_through_its_own_copies():
    run = CopyRun(TokenHistory(2, [1, 2, 3, 4, 1, 2]))
    copied = []
    for _ in range(5):
        token = run.proposal()
        copied.append(token)
        run.push(token)
    assert copied == [3, 4, 1, 2, 3]  # the text after "1 2", then the copies' own continuation


def test_a_drafted_token_that_differs_ends_the_run_and_the_next_position_looks_again():
    run = CopyRun(TokenHistory(1, [7, 8, 9, 7]))
    assert run.proposal() == 8 and run.confidence == FIRST_COPY_CONFIDENCE[1]
    run.push(8)
    assert run.proposal() == 9 and run.confidence == NEXT_COPY_CONFIDENCE
    run.push(3)  # not the copy: the run stops
    assert run.proposal() is None  # 3 never occurred
    run.push(7)
    assert run.proposal() == 8  # a new run: after the committed 7 at 3 came the first draft, 8


def test_no_proposal_without_a_repeat():
    assert CopyRun(TokenHistory(3, [1, 2, 3])).proposal() is None
