"""Who is syncing: a sidecar proves its pod with a projected service-account token (audience
``kvgate-agent``), checked with a TokenReview (``authentication.k8s.io/v1``).

Invariant: the claimed pod (the sync report's namespace, name and uid) must be the pod the token
is bound to, so a pod cannot read or report for another; results are cached by a hash of the
token, never the token itself, in a bounded cache.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kvgate_agent.contract.sync import TOKEN_AUDIENCE

log = logging.getLogger(__name__)

POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
POD_UID_EXTRA = "authentication.kubernetes.io/pod-uid"
SA_PREFIX = "system:serviceaccount:"


class AuthError(Exception):
    """A sync refused: ``status`` is 401 (no or invalid token) or 403 (valid, wrong pod);
    ``code`` a stable label for metrics and the error body."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class PodIdentity:
    """The pod a token is bound to."""

    namespace: str
    name: str
    uid: str
    service_account: str


@dataclass(frozen=True, slots=True)
class Review:
    """A TokenReview's answer: ``identity`` when authenticated and bound to a pod, else
    ``error`` (with ``status`` 401 or 403)."""

    identity: PodIdentity | None
    status: int = 200
    code: str = "ok"
    error: str = ""


#: ``(token) -> Review``; may block (runs in a thread).
TokenReviewer = Callable[[str], Review]


def review_from_status(status: dict[str, Any], audience: str = TOKEN_AUDIENCE) -> Review:
    """Interpret a TokenReview ``status`` (as the API server returns it, camelCase JSON).

    Returns a :class:`Review`: 401 when not authenticated or issued for another audience, 403
    when authenticated but not a service-account token bound to a pod.
    """
    if not status.get("authenticated"):
        return Review(None, 401, "invalid_token", status.get("error") or "token not accepted")
    audiences = status.get("audiences")
    if audiences is not None and audience not in audiences:
        return Review(None, 401, "wrong_audience", f"token is not for audience {audience!r}")
    user = status.get("user") or {}
    username = user.get("username") or ""
    extra = user.get("extra") or {}
    names, uids = extra.get(POD_NAME_EXTRA) or [], extra.get(POD_UID_EXTRA) or []
    parts = username[len(SA_PREFIX) :].split(":") if username.startswith(SA_PREFIX) else []
    if len(parts) != 2 or len(names) != 1 or len(uids) != 1:
        return Review(
            None, 403, "not_pod_bound", "token is not a service-account token bound to a pod"
        )
    return Review(PodIdentity(parts[0], names[0], uids[0], parts[1]))


def kube_token_reviewer(api_client: Any, audience: str = TOKEN_AUDIENCE) -> TokenReviewer:
    """A :data:`TokenReviewer` calling the API server through a ``kubernetes`` ApiClient
    (needs RBAC ``create`` on ``tokenreviews``, as in ``system:auth-delegator``)."""
    from kubernetes import client

    api = client.AuthenticationV1Api(api_client)

    def review(token: str) -> Review:
        body = client.V1TokenReview(
            spec=client.V1TokenReviewSpec(token=token, audiences=[audience])
        )
        # Below the sidecar's sync timeout (2 s), so a hung API server fails the review in time.
        result = api.create_token_review(body, _request_timeout=1.5)
        return review_from_status(api_client.sanitize_for_serialization(result.status) or {})

    return review


def token_expiry(token: str) -> float | None:
    """The ``exp`` claim (Unix seconds) of a JWT, read without checking its signature; None when
    ``token`` is not a JWT with a numeric ``exp``.

    Only ever used to *shorten* how long an accepted token is trusted (the TokenReview checked
    the signature): a token must not outlive its own expiry in the cache (RFC 7519 section
    4.1.4, https://www.rfc-editor.org/rfc/rfc7519#section-4.1.4).
    """
    parts = token.split(".")
    if len(parts) != 3:
        return None
    try:
        payload = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
    except (binascii.Error, ValueError):
        return None
    exp = payload.get("exp") if isinstance(payload, dict) else None
    if isinstance(exp, bool) or not isinstance(exp, int | float):
        return None
    return float(exp)


class Authenticator:
    """Checks sync tokens against the claimed pod, with a bounded cache.

    The pod comes from the reviewed user's extra fields ``authentication.kubernetes.io/pod-name``
    and ``authentication.kubernetes.io/pod-uid`` (bound service account tokens, Kubernetes docs
    "Managing Service Accounts"), the namespace from the username
    ``system:serviceaccount:<namespace>:<name>``. Accepted tokens are cached for ``ok_ttl``
    seconds, refused ones for ``refused_ttl``, at most ``max_entries`` kept: a sidecar syncing
    every second costs one TokenReview a minute, and a flood of bad tokens cannot grow memory
    without bound.

    Args:
        reviewer: performs a TokenReview (blocking; called in a worker thread).
        clock: monotonic seconds (injected).
        ok_ttl: seconds an accepted token is trusted without asking again.
        refused_ttl: seconds a refused token stays refused without asking again.
        stale_ttl: when the API server cannot be asked (down, or the request fails), a token
            accepted within this many seconds stays accepted: an API server outage must not
            turn into an outage of every model pod (the answer is the same thresholds the pod
            already holds). No acceptance outlives the token's own ``exp`` (projected tokens
            expire after 1 h by default).
        retry_after_failure: after a failed TokenReview, no new one is tried for this many
            seconds (recent acceptances are used, others get 503 at once), so a hung API server
            does not make every sync wait for its own review.
        max_entries: cache bound.
        wall: Unix seconds (injected), to compare with a token's ``exp``: no acceptance, fresh
            or stale, is trusted past the token's own expiry (:func:`token_expiry`).

    Concurrent checks of one token share a single TokenReview (its own task: cancelling one
    caller never cancels the others).
    """

    def __init__(
        self,
        reviewer: TokenReviewer,
        clock: Callable[[], float] = time.monotonic,
        *,
        ok_ttl: float = 60.0,
        refused_ttl: float = 5.0,
        stale_ttl: float = 600.0,
        retry_after_failure: float = 5.0,
        max_entries: int = 4096,
        run: Callable[[Callable[[], Review]], Awaitable[Review]] | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.reviewer = reviewer
        self.clock = clock
        self.wall = wall
        self.ok_ttl = ok_ttl
        self.refused_ttl = refused_ttl
        self.stale_ttl = max(stale_ttl, ok_ttl)
        self.retry_after_failure = retry_after_failure
        self._down_until = float("-inf")
        self.max_entries = max_entries
        # key -> (review, fresh until, usable when the API server is unreachable until)
        self._cache: OrderedDict[str, tuple[Review, float, float]] = OrderedDict()
        self._pending: dict[str, asyncio.Future[Review]] = {}
        self._run = run or (lambda fn: asyncio.to_thread(fn))
        self.reviews = 0  # TokenReviews sent (for metrics)
        self.review_errors = 0  # TokenReviews that failed (API server unreachable, RBAC)
        self.stale_uses = 0  # checks answered from a stale acceptance during such failures

    async def verify(
        self, authorization: str | None, namespace: str, name: str, uid: str | None
    ) -> PodIdentity:
        """The identity behind an ``Authorization`` header, checked against the claimed pod.

        Raises:
            AuthError: 401 without a bearer token or when the API server does not accept it;
                403 when it belongs to another pod (namespace, name or uid differ) or is not
                pod-bound; 503 ``review_unavailable`` when the API server cannot be asked and
                the token was not accepted recently (not cached: the next sync asks again).
        """
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise AuthError(401, "missing_token", "send Authorization: Bearer <pod token>")
        key = hashlib.sha256(token.encode()).hexdigest()
        review = await self._review(key, token)
        ident = review.identity
        if ident is None:
            raise AuthError(review.status, review.code, review.error)
        if (ident.namespace, ident.name) != (namespace, name) or (uid and uid != ident.uid):
            raise AuthError(
                403,
                "wrong_pod",
                f"token belongs to pod {ident.namespace}/{ident.name}, "
                f"not {namespace}/{name}" + (f" (uid {uid})" if uid else ""),
            )
        return ident

    async def _review(self, key: str, token: str) -> Review:
        now = self.clock()
        hit = self._cache.get(key)
        if hit is not None and hit[1] > now:
            return hit[0]
        stale = hit is not None and hit[0].identity is not None and hit[2] > now
        if now < self._down_until:
            # The API server failed a moment ago: do not queue another slow review per sync.
            return self._unavailable(hit[0] if stale and hit is not None else None)
        task = self._pending.get(key)
        if task is None:
            # Its own task, so one caller's cancellation never cancels the others' answer.
            task = asyncio.ensure_future(self._ask(key, token, now))
            self._pending[key] = task
            task.add_done_callback(lambda _t: self._pending.pop(key, None))
        try:
            return await asyncio.shield(task)
        except _ReviewFailed:
            return self._unavailable(hit[0] if stale and hit is not None else None)

    async def _ask(self, key: str, token: str, now: float) -> Review:
        self.reviews += 1
        try:
            review = await self._run(lambda: self.reviewer(token))
        except Exception as exc:  # the API server cannot be asked
            self.review_errors += 1
            self._down_until = self.clock() + self.retry_after_failure
            log.warning("TokenReview failed: %s", exc)
            raise _ReviewFailed() from exc
        ok = review.identity is not None
        fresh = now + (self.ok_ttl if ok else self.refused_ttl)
        stale = now + self.stale_ttl if ok else fresh
        expiry = token_expiry(token) if ok else None
        if expiry is not None:  # never trusted past its own exp, on the monotonic clock
            left = max(0.0, expiry - self.wall())
            fresh, stale = min(fresh, now + left), min(stale, now + left)
        self._cache[key] = (review, fresh, stale)
        self._cache.move_to_end(key)
        while len(self._cache) > self.max_entries:
            self._cache.popitem(last=False)
        return review

    def _unavailable(self, stale: Review | None) -> Review:
        if stale is not None:
            self.stale_uses += 1
            return stale  # accepted recently: the API server's trouble is not the pod's
        return Review(None, 503, "review_unavailable", "cannot verify the token now")


class _ReviewFailed(Exception):
    """The TokenReview could not be made (the API server is unreachable or refused it)."""
