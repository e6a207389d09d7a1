"""Moved to transom.faults. Kept only so that `transom/cli.py` (owned elsewhere) keeps working
until it imports `transom.faults.parse_schedule`; then delete this file."""

from transom.faults import parse_schedule

__all__ = ["parse_schedule"]
