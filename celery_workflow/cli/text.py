"""What the command line prints of stored data, made safe for a terminal.

Run ids, workflow and step names, inputs, outputs, errors, stream values, dead letters' queues and messages are
whatever producers and workflows stored, possibly hostile: printed raw, an escape sequence among them would drive the
operator's terminal (move the cursor, rewrite what is shown, set the window title, on some terminals more). Every
command prints stored data through :func:`shown` (plain output) or :func:`safe_json` (``--json``):

* :func:`shown` writes each character a terminal may act on, or that breaks a line, as a visible escape: C0 controls
  (newline and tab included: every field is printed on one line), DEL and C1 controls as ``\\x1b``, ``\\x9b`` …;
  lone surrogates (text that is not Unicode, which cannot be encoded for output) as ``\\udc80``; the Unicode
  controls that reorder or break displayed text (bidirectional embeddings, overrides and isolates, the line and
  paragraph separators) as ``\\u202e`` …. A backslash stays as it is: this is for reading, ``--json`` is exact.
* :func:`safe_json` is ``json.dumps`` (which escapes C0 controls itself) with the other characters above written as
  JSON ``\\uXXXX`` escapes, so the text is the same JSON value and no raw control reaches the terminal.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["safe_json", "shown"]

# C0, DEL and C1 controls; lone surrogates; bidirectional formatting controls and the line/paragraph separators.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")
# The same but C0 (json.dumps has escaped those already, and a raw one cannot be left in its output).
_UNSAFE_IN_JSON = re.compile("[\x7f-\x9f\ud800-\udfff\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def _json_escape(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def shown(value: Any) -> str:
    """``str(value)`` with every character a terminal could act on written as a visible escape (see the module
    docstring)."""
    return _UNSAFE.sub(_escape, value if isinstance(value, str) else str(value))


def safe_json(value: Any, **options: Any) -> str:
    """``json.dumps(value, ensure_ascii=False, default=str, **options)`` with the characters :func:`shown` escapes
    (but C0, which JSON escapes itself) written as ``\\uXXXX``: the same JSON value, safe to print."""
    return _UNSAFE_IN_JSON.sub(_json_escape, json.dumps(value, ensure_ascii=False, default=str, **options))
