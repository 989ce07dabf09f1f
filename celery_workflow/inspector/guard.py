"""Who may do what in the inspector, and the protection of its forms.

**Authorization.** ``authorize(request, action) -> bool`` is the contract of ``api.rpc_blueprint``'s ``authorize``
(the Flask request and a name); a denied request gets ``401`` when it carries no ``Authorization`` header and
``403`` otherwise. The names (:data:`ACTIONS`):

* ``"view"``: every page and the live tail;
* ``"reveal_token"``: showing a hook's token (and a webhook's URL, which contains it);
* ``"cancel"``, ``"resume_hook"``, ``"redrive"``, ``"pause_schedule"`` (pause or resume a schedule): the POST
  actions.

Without ``authorize`` the pages are open to whoever reaches them, and token reveals and actions are refused with
``403`` unless the blueprint was created with ``allow_actions=True``: the safe default is a read-only inspector.

**CSRF.** The forms are protected by a double-submit cookie: the first page that shows a form sets a random token in
the cookie :data:`COOKIE` (``HttpOnly``, ``SameSite=Strict``, ``Secure`` over HTTPS, scoped to the blueprint's path)
and puts the same token in each form's hidden field :data:`FIELD`; a POST is accepted only when the two are present
and equal (compared in constant time) and its ``Origin`` header, when sent, names this host. Another site can make a
browser post a form but can neither read nor set the cookie, so it cannot send the matching field. No server-side
session or secret key is needed, so any number of server processes agree.

**Headers.** Every answer carries a Content-Security-Policy that allows only this blueprint's stylesheet and the
page's own inline script (by nonce), ``X-Content-Type-Options: nosniff``, ``X-Frame-Options: DENY``,
``Referrer-Policy: same-origin`` and ``Cache-Control: no-store`` (pages show live state and, when revealed, tokens).
"""

from __future__ import annotations

import hmac
import re
import secrets
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from flask import Response, g, request

#: ``authorize(request, action)``: True lets the request through (the contract of ``api.Authorize``).
Authorize = Callable[[Any, str], bool]

VIEW = "view"
REVEAL = "reveal_token"
CANCEL = "cancel"
RESUME = "resume_hook"
REDRIVE = "redrive"
SCHEDULE = "pause_schedule"
ACTIONS = (VIEW, REVEAL, CANCEL, RESUME, REDRIVE, SCHEDULE)

COOKIE = "cw_inspector_csrf"
FIELD = "csrf_token"
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{43}$")  # secrets.token_urlsafe(32)


class Guard:
    """Decides, per request, whether an action is allowed (see the module docstring)."""

    def __init__(self, authorize: Authorize | None, allow_actions: bool) -> None:
        self.authorize = authorize
        self.allow_actions = allow_actions

    def allows(self, action: str) -> bool:
        if self.authorize is not None:
            return bool(self.authorize(request, action))
        return action == VIEW or self.allow_actions

    def denial(self, action: str) -> tuple[int, str] | None:
        """None when ``action`` is allowed for this request, else the status and the reason."""
        if self.allows(action):
            return None
        if self.authorize is None:
            return 403, (
                f"{action}: this inspector is read-only (it was created without authorize= and without"
                " allow_actions=True)"
            )
        if "Authorization" not in request.headers:
            return 401, f"{action}: credentials required"
        return 403, f"{action}: not allowed"


# -- CSRF -------------------------------------------------------------------------------------------------------------


def csrf_token() -> str:
    """The token for this request's forms: the cookie's, or a new one the response sets (see :func:`finish`)."""
    token = request.cookies.get(COOKIE, "")
    if _TOKEN.match(token):
        return token
    new: str | None = g.get("cwi_csrf_new")
    if new is None:
        new = secrets.token_urlsafe(32)
        g.cwi_csrf_new = new
    return new


def csrf_problem() -> str | None:
    """Why this POST fails the CSRF check, or None when it passes."""
    origin = request.headers.get("Origin")
    if origin is not None and urlsplit(origin).netloc != request.host:
        return f"a form posted from another origin ({origin}) is refused"
    cookie = request.cookies.get(COOKIE, "")
    if not _TOKEN.match(cookie):
        return "the form's CSRF cookie is missing (cookies blocked, or it expired): reload the page and submit again"
    sent = request.form.get(FIELD, "")
    if not hmac.compare_digest(cookie.encode(), sent.encode()):
        return "the form's CSRF token does not match its cookie: reload the page and submit again"
    return None


# -- headers ----------------------------------------------------------------------------------------------------------


def nonce() -> str:
    """This request's script nonce (the Content-Security-Policy allows inline scripts that carry it)."""
    value: str | None = g.get("cwi_nonce")
    if value is None:
        value = secrets.token_urlsafe(16)
        g.cwi_nonce = value
    return value


def finish(response: Response, cookie_path: str) -> Response:
    """Set a new CSRF cookie if this request made one, and the security headers."""
    new = g.pop("cwi_csrf_new", None)
    if new is not None:
        response.set_cookie(COOKIE, new, httponly=True, samesite="Strict", secure=request.is_secure, path=cookie_path)
    headers = response.headers
    headers.setdefault(
        "Content-Security-Policy",
        "default-src 'none'; style-src 'self'; img-src 'self' data:; connect-src 'self';"
        f" script-src 'nonce-{nonce()}'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    )
    headers.setdefault("X-Content-Type-Options", "nosniff")
    headers.setdefault("X-Frame-Options", "DENY")
    headers.setdefault("Referrer-Policy", "same-origin")
    headers.setdefault("Cache-Control", "no-store")
    return response
