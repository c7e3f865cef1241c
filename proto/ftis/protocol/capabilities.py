"""Client capabilities: what a registering client does beyond the base protocol
(``RegisterPayload.capabilities``, ``swarm.proto``).

A coordinator must not send a client something an older client would misuse. Each
capability names one such behaviour; the client lists the ones it has when it registers,
and the coordinator stores those it knows (:func:`known_capabilities`) with the node.
"""

from __future__ import annotations

from collections.abc import Iterable

#: The client never trains on a ``RelayedBundle`` with ``audit_only`` set; it audits it
#: with its pre-update weights and reports the log-ratio statistics as feedback
#: (docs/reputation.md "Audit-based probation"). Only nodes with it are relayed
#: audit-only bundles: a client without it would train on them.
AUDIT_ONLY_RELAY = "audit-only-relay"

#: Every capability this release knows, in a fixed order.
KNOWN: tuple[str, ...] = (AUDIT_ONLY_RELAY,)

#: What this release's client registers with.
CLIENT_CAPABILITIES: tuple[str, ...] = (AUDIT_ONLY_RELAY,)

#: Most entries and characters per entry a registration may list (REGISTRATION_INVALID
#: beyond), so a registration cannot grow the node record without bound.
MAX_CAPABILITIES = 32
MAX_CAPABILITY_CHARS = 64


def known_capabilities(listed: Iterable[str]) -> tuple[str, ...]:
    """The capabilities of ``listed`` this release knows, without repeats, in
    :data:`KNOWN`'s order (unknown ones, from newer clients, are dropped)."""
    present = set(listed)
    return tuple(c for c in KNOWN if c in present)
