"""Public-set failures grouped by cause, from reading them (REPORT.md's groups).

``label -> (description, keys)``; keys are ``"<torch suite>.<test>"``.  The
report places each failing test under the first group listing it; failures
listed nowhere are grouped by error line.  A test listed here that passes is
flagged in the report: take it out.
"""

from __future__ import annotations

__all__ = ["KNOWN_FAILURES"]

KNOWN_FAILURES: dict[str, tuple[str, tuple[str, ...]]] = {
}
