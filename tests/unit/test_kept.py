"""services.common.kept: a value is made once while kept, and the least recently used is dropped first."""

from services.common.kept import kept


def test_a_kept_value_is_made_once_and_the_least_recently_used_goes_first():
    made = []

    def make(key):
        return lambda: made.append(key) or key * 10

    values: dict = {}
    assert [kept(values, k, make(k), limit=2) for k in (1, 2, 1, 3, 1, 2)] == [10, 20, 10, 30, 10, 20]
    # 1 was used again before 3 came, so 2 went first; then 3 went when 2 came back
    assert made == [1, 2, 3, 2] and list(values) == [1, 2]
