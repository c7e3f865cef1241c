"""The coordinator's operations as plain functions over a :class:`Context`.

One module per concern (Flower's ``message_handler`` style): the gRPC servicers in
:mod:`ftis.coordinator.server` only translate messages and call these. Each handler
raises :class:`~ftis.protocol.errors.FtisError` on a rejection.

- :mod:`.nodes`: registration, authentication, heartbeat, tokenizer upload
- :mod:`.leases`: task leases
- :mod:`.bundles`: the submit path (one read, pure verification, one write)
- :mod:`.relay`: relay pages
- :mod:`.feedback`: metrics reports and receiver feedback
- :mod:`.admin`: operator reads and actions
"""
