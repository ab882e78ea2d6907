"""A database URL is printed and logged without its password."""

from __future__ import annotations

from treadle.common.db.engine import shown_url


def test_the_password_is_hidden() -> None:
    shown = shown_url("postgresql+psycopg://alice:s3cret-pw@db.example:5432/treadle")
    assert "s3cret-pw" not in shown
    assert shown == "postgresql+psycopg://alice:***@db.example:5432/treadle"


def test_urls_without_a_password_are_unchanged() -> None:
    assert shown_url("sqlite:////data/treadle.db") == "sqlite:////data/treadle.db"


def test_an_unparsable_url_is_not_echoed() -> None:
    assert "hunter2" not in shown_url("::hunter2::")
