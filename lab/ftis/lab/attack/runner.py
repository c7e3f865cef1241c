"""Run one attacker: load the policy, register, then run the kind's rounds.

Unlike the honest client, an attacker does not stop at the first coded rejection of a
round: it logs the error and goes on (it wants to see how the coordinator reacts over
time) until it is banned, ``rounds`` are done, or too many rounds in a row failed.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from ftis.lab.attack.nodes import NODE_CLASSES, AttackLog, AttackOptions, code_label

log = logging.getLogger(__name__)
#: Rounds in a row that may fail before the attacker gives up.
MAX_FAILED_ROUNDS = 30
#: Pause between rounds of attackers that run no model (flooder, garbage, sybil_burst).
DRIVER_ROUND_PAUSE_S = 1.0
#: Longest wait for the ``wait_for`` file.
WAIT_FOR_TIMEOUT_S = 600.0


def run_attack(cfg: Any, kind: str, options: AttackOptions, log_path: Path | None = None,
               on_round: Any = None) -> int:
    """Run attacker ``kind`` with client settings ``cfg`` (a ``ClientConfig``).

    Returns:
        an exit code of :mod:`ftis.client.cli.exit_codes` (0 also when banned: being
        banned is an expected outcome of an attack).
    """
    import grpc

    from ftis.client.cli import exit_codes
    from ftis.client.models.loader import load_policy
    from ftis.client.node.runtime import configure_runtime
    from ftis.client.swarm.connection import SwarmConnection
    from ftis.protocol.errors import ErrorCode, FtisError
    from ftis.protocol.identity import NodeIdentity

    if kind not in NODE_CLASSES:
        raise ValueError(f"unknown attack kind {kind!r}; one of {sorted(NODE_CLASSES)}")
    configure_runtime(cfg)
    identity = NodeIdentity.load_or_create(cfg.key_file)
    attack_log = AttackLog(log_path or Path(cfg.out) / "attack.jsonl", kind, identity.node_id)
    policy = load_policy(cfg.model, peft=cfg.peft, lora=cfg.lora_settings,
                         double_quant=cfg.qlora_double_quant)
    conn = SwarmConnection(cfg.coordinator, identity, policy.card, retries=3,
                           display_name=cfg.display_name or f"attack/{kind}",
                           tokenizer_json=policy.tokenizer_json)
    attack_log.write("start", 0, model=cfg.model, rounds=cfg.rounds,
                     options=vars(options))
    try:
        try:
            conn.register()
        except FtisError as exc:
            attack_log.write("register", 0, code=exc.code, code_name=code_label(exc.code),
                             reason=exc.reason)
            return exit_codes.REJECTED
        node = NODE_CLASSES[kind](cfg, policy, conn, attack_log, options)
        if options.wait_for:
            deadline = time.monotonic() + WAIT_FOR_TIMEOUT_S
            while not Path(options.wait_for).exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            attack_log.write("go", 0)
        failed = 0
        driver = kind in ("flooder", "garbage", "sybil_burst")
        while cfg.rounds == 0 or node.round < cfg.rounds:
            before = node.round
            try:
                result = node.run_round()
                failed = 0
                if on_round is not None:
                    on_round(result)
            except FtisError as exc:
                attack_log.write("round_error", node.round + 1, code=exc.code,
                                 code_name=code_label(exc.code), reason=exc.reason)
                if exc.code == ErrorCode.NODE_BANNED:
                    attack_log.write("banned", node.round + 1, reason=exc.reason)
                    return exit_codes.OK
                failed += 1
                if failed >= MAX_FAILED_ROUNDS:
                    return exit_codes.REJECTED
                if node.round == before:
                    time.sleep(1.0)
            except grpc.RpcError as exc:
                attack_log.write("round_error", node.round + 1, code=f"grpc:{exc.code().name}",
                                 code_name=f"grpc:{exc.code().name}", reason=str(exc.details()))
                failed += 1
                if failed >= MAX_FAILED_ROUNDS:
                    return exit_codes.COORDINATOR_UNREACHABLE
                time.sleep(1.0)
            if driver:
                time.sleep(DRIVER_ROUND_PAUSE_S)
        attack_log.write("done", node.round)
        return exit_codes.OK
    except KeyboardInterrupt:
        return exit_codes.INTERRUPTED
    finally:
        conn.close()
