"""Text from elsewhere as it may reach a terminal: what every printer of the CLI applies to
messages, table cells and warnings that quote nodes, stores, sandboxes and images."""

from __future__ import annotations

import re

#: what a terminal would act on rather than show: C0 controls but tab and newline (ESC
#: starts a sequence that can retitle the window, clear the screen or move the cursor), DEL,
#: the C1 controls (U+009B is a CSI of its own) and the bidirectional overrides and isolates
#: (they reorder what is shown)
_CONTROL = "[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]"


def terminal_safe(text: str) -> str:
    """``text`` as it may reach a terminal: each control character shown escaped (``\\x1b``,
    ``\\u202e``), bytes that are not UTF-8 (lone surrogates) likewise. Error messages quote
    what nodes, store objects, sandboxes and images said: it is shown, never obeyed."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return re.sub(_CONTROL, lambda m: m.group().encode("unicode_escape").decode("ascii"),
                  text)
