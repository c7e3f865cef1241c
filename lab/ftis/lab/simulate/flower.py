"""The Flower apps of ``ftis-lab simulate``: the only module of FTIS that imports
``flwr`` (``make flower-env``: flwr[simulation] 1.41 in ``.venv-flower``).

* :data:`client_app`: a ``ClientApp`` whose every instance is one FTIS learner
  (:class:`~ftis.lab.simulate.learner.SimLearner`, index = the SuperNode's
  ``partition-id``), answering three message types: ``query.register``,
  ``train.sample`` and ``train.learn``.
* :func:`make_server_app`: a ``ServerApp`` whose ``main`` plays the coordinator
  (:class:`~ftis.lab.simulate.coordinator.SimCoordinator`): it registers every learner,
  then per round sends each one its heartbeat and lease replies, verifies and stores the
  signed bundles they answer with, sends back the verdicts and the relay pages, and
  applies their metric reports.
* :func:`run_flower`: both in ``flwr.simulation.run_simulation`` (Ray backend).
  flwr 1.41 marks ``run_simulation`` deprecated in favour of ``flwr run``; it is used
  here because the ServerApp hands its summary back to the caller in this process, and
  because ``flwr run`` would package the apps as a FAB project of their own.

Messages carry one ``ConfigRecord`` named ``"ftis"`` whose values are serialized
``ftis.v1`` messages (bytes), ints and strings; no weights.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # read when flwr is imported
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

from flwr.app import ConfigRecord, Context, Message, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402
from flwr.simulation import run_simulation  # noqa: E402

from ftis.lab.simulate.coordinator import PullPlan, SimCoordinator  # noqa: E402
from ftis.lab.simulate.learner import (  # noqa: E402
    SimLearner,
    SimulationError,
    forget,
    keep,
    live_learner,
)
from ftis.lab.simulate.spec import LearnerRound, SwarmSpec, SwarmSummary  # noqa: E402
from ftis.v1 import swarm_pb2  # noqa: E402

log = logging.getLogger(__name__)

#: The record every message and the ClientApp's context carry.
RECORD = "ftis"
#: Seconds the ServerApp waits for the engine's SuperNodes to appear.
NODES_TIMEOUT_S = 300.0

client_app = ClientApp()


def _record(values: dict[str, Any]) -> RecordDict:
    return RecordDict({RECORD: ConfigRecord(values)})


def _values(msg: Message) -> Any:
    return msg.content[RECORD]


def _learner(context: Context) -> tuple[SimLearner, dict[str, Any]]:
    """This SuperNode's learner as of its last message, and its context record."""
    state = context.state[RECORD]
    spec = SwarmSpec.model_validate_json(str(state["spec"]))
    snapshot = state["snapshot"] if "snapshot" in state else None
    learner = live_learner(str(state["run"]), spec, int(state["index"]), int(state["step"]),
                           bytes(snapshot) if snapshot else None)
    return learner, state


def _done(context: Context, state: Any, learner: SimLearner) -> None:
    """Count the message; with snapshots on, write the learner's state to the context."""
    step = int(state["step"]) + 1
    state["step"] = step
    keep(str(state["run"]), learner.index, step, learner)
    if bool(state["snapshots"]):
        state["snapshot"] = learner.snapshot()
    context.state[RECORD] = state


@client_app.query("register")
def register(msg: Message, context: Context) -> Message:
    """Build learner ``partition-id`` and answer with its signed registration."""
    values = _values(msg)
    index = int(context.node_config["partition-id"])
    state = ConfigRecord({"spec": values["spec"], "run": values["run"], "index": index,
                          "step": 0, "snapshots": values["snapshots"]})
    context.state[RECORD] = state
    learner, state = _learner(context)
    envelope, fingerprint, gz = learner.register()
    _done(context, state, learner)
    return Message(_record({"index": index, "node_id": learner.node_id,
                            "envelope": envelope, "fingerprint": fingerprint,
                            "tokenizer": gz}), reply_to=msg)


@client_app.train("sample")
def sample(msg: Message, context: Context) -> Message:
    """Round phase 1: sample on the heartbeat and lease replies, answer with the signed
    bundles and the relay cursor."""
    values = _values(msg)
    learner, state = _learner(context)
    answer = learner.sample(bytes(values["heartbeat"]), bytes(values["lease"]))
    _done(context, state, learner)
    return Message(_record({"envelopes": answer.envelopes, "pull": answer.pull.wanted,
                            "cursor": answer.pull.cursor,
                            "fingerprint": answer.pull.fingerprint}), reply_to=msg)


@client_app.train("learn")
def learn(msg: Message, context: Context) -> Message:
    """Round phase 2: the verdicts and relay pages in, the learner step, answer with the
    metrics report."""
    values = _values(msg)
    learner, state = _learner(context)
    answer = learner.learn([bytes(b) for b in values["submitted"]],
                           [bytes(b) for b in values["pages"]])
    _done(context, state, learner)
    return Message(_record({"report": answer.report,
                            "metrics": json.dumps(answer.metrics)}), reply_to=msg)


@dataclass
class ServerResult:
    """What the ServerApp leaves behind (it runs in a thread of this process)."""

    summary: SwarmSummary = field(default_factory=SwarmSummary)
    error: BaseException | None = None


def _exchange(grid: Grid, messages: list[Message], what: str) -> dict[int, Any]:
    """Send ``messages``, wait for every reply; ``{flower node id: its record}``.

    Raises:
        SimulationError: a ClientApp failed (its error's reason included).
    """
    replies = list(grid.send_and_receive(messages))
    out: dict[int, Any] = {}
    for reply in replies:
        if reply.has_error():
            raise SimulationError(f"{what}: node {reply.metadata.src_node_id} failed: "
                                  f"{reply.error.reason}")
        out[reply.metadata.src_node_id] = _values(reply)
    if len(out) != len(messages):
        raise SimulationError(f"{what}: {len(out)} of {len(messages)} replies")
    return out


def make_server_app(spec: SwarmSpec, result: ServerResult, *, snapshots: bool,
                    db: str) -> ServerApp:
    """The coordinator as a ``ServerApp`` for ``spec`` (``rounds`` rounds of all
    ``learners``); its summary goes to ``result.summary``.

    Args:
        snapshots: learners write their state to their context after each message
            (needed when the engine has more than one actor).
        db: the coordinator's database (SQLite path or ``sqlite://``).
    """
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            _serve(grid, spec, result, snapshots, db)
        except BaseException as exc:
            result.error = exc
            raise

    return app


def _serve(grid: Grid, spec: SwarmSpec, result: ServerResult, snapshots: bool,
           db: str) -> None:
    t_setup = time.perf_counter()
    run_key = uuid.uuid4().hex
    fids: list[int] = []
    deadline = time.monotonic() + NODES_TIMEOUT_S
    while len(fids) < spec.learners:  # the engine registers its SuperNodes meanwhile
        if time.monotonic() > deadline:
            raise SimulationError(f"{len(fids)} of {spec.learners} SuperNodes after "
                                  f"{NODES_TIMEOUT_S:g} s")
        time.sleep(0.05)
        fids = sorted(grid.get_node_ids())
    coord = SimCoordinator(spec.coordinator_config(db))
    try:
        spec_json = spec.model_dump_json()
        replies = _exchange(grid, [Message(
            _record({"spec": spec_json, "run": run_key, "snapshots": snapshots}),
            dst_node_id=fid, message_type="query.register", group_id="register")
            for fid in fids], "register")
        index_of = {fid: int(r["index"]) for fid, r in replies.items()}
        order = sorted(fids, key=index_of.__getitem__)  # learner index order
        node_of: dict[int, str] = {}
        for fid in order:
            r = replies[fid]
            answer = swarm_pb2.RegisterResponse.FromString(coord.register(
                bytes(r["envelope"]), str(r["fingerprint"]), bytes(r["tokenizer"])))
            if answer.error.code:
                raise SimulationError(f"learner {index_of[fid]} not registered: "
                                      f"{answer.error.reason}")
            node_of[fid] = str(r["node_id"])
        summary = result.summary
        summary.setup_s = time.perf_counter() - t_setup
        started = time.perf_counter()
        for rnd in range(spec.rounds):
            group = f"round-{rnd + 1}"
            sampled = _exchange(grid, [Message(_record({
                "heartbeat": coord.heartbeat(node_of[fid], rnd),
                "lease": coord.lease(node_of[fid], spec.local_groups, spec.group_size,
                                     spec.max_new_tokens)}),
                dst_node_id=fid, message_type="train.sample", group_id=group)
                for fid in order], f"{group} sample")
            verdicts = {fid: [coord.submit(bytes(e)) for e in sampled[fid]["envelopes"]]
                        for fid in order}
            pages = {fid: coord.pull(node_of[fid], PullPlan(
                bool(sampled[fid]["pull"]), int(sampled[fid]["cursor"]),
                str(sampled[fid]["fingerprint"]))) for fid in order}
            learned = _exchange(grid, [Message(_record({
                "submitted": verdicts[fid], "pages": pages[fid]}),
                dst_node_id=fid, message_type="train.learn", group_id=group)
                for fid in order], f"{group} learn")
            for fid in order:
                coord.report(node_of[fid], bytes(learned[fid]["report"]))
                summary.rounds.append(LearnerRound(node_of[fid], rnd + 1, json.loads(
                    str(learned[fid]["metrics"]))))
            log.info("%s done: %d learners, %.1f s so far", group, len(order),
                     time.perf_counter() - started)
        summary.wall_s = time.perf_counter() - started
        end = coord.totals([node_of[fid] for fid in order])
        summary.bundles_accepted, summary.bundles_rejected = (end.bundles_accepted,
                                                              end.bundles_rejected)
        summary.verified_rewards, summary.reputations = end.verified_rewards, end.reputations
    finally:
        coord.close()
        forget(run_key)


def backend_config(client_cpus: float, client_gpus: float, ray_address: str | None,
                   ray_cpus: int | None) -> dict[str, Any]:
    """``run_simulation``'s ``backend_config``: resources per ClientApp actor
    (``client_resources``) and ``ray.init`` arguments (``init_args``: ``address`` of a
    running Ray cluster, or ``num_cpus`` of the local one)."""
    init: dict[str, Any] = {}
    if ray_address:
        init["address"] = ray_address
    elif ray_cpus:
        init["num_cpus"] = ray_cpus
    return {"client_resources": {"num_cpus": client_cpus, "num_gpus": client_gpus},
            "init_args": init}


def run_flower(spec: SwarmSpec, *, client_cpus: float = 1.0, client_gpus: float = 0.0,
               ray_address: str | None = None, ray_cpus: int | None = None,
               snapshots: bool = True, verbose: bool = False) -> SwarmSummary:
    """Run ``spec`` in Flower's simulation engine (Ray backend); the coordinator's
    database is ``out/simulated.db``.

    Args:
        client_cpus, client_gpus: resources of one ClientApp actor (fractions allowed:
            ``client_gpus=0.25`` puts four learners' actors on a GPU).
        ray_address: a running Ray cluster (``ray start --head``; ``"auto"``), or
            ``None`` to start a local one.
        ray_cpus: CPUs of the local Ray instance (default: all).
        snapshots: learners keep their state in their context (required with more
            than one actor; off saves a copy of the weights per message).

    Raises:
        SimulationError: a ClientApp failed, or the ServerApp did.
    """
    spec.out.mkdir(parents=True, exist_ok=True)
    db = spec.out / "simulated.db"
    db.unlink(missing_ok=True)
    from ftis.lab.simulate.learner import model_path

    model_path(spec)  # build the tiny model once, before the actors start
    result = ServerResult()
    run_simulation(server_app=make_server_app(spec, result, snapshots=snapshots,
                                              db=str(db)),
                   client_app=client_app, num_supernodes=spec.learners,
                   backend_name="ray",
                   backend_config=backend_config(  # type: ignore[arg-type]
                       client_cpus, client_gpus, ray_address, ray_cpus),
                   verbose_logging=verbose)
    if result.error is not None:
        raise SimulationError(f"the ServerApp failed: {result.error}") from result.error
    if len(result.summary.rounds) != spec.learners * spec.rounds:
        raise SimulationError(f"{len(result.summary.rounds)} learner rounds of "
                              f"{spec.learners * spec.rounds}")
    return result.summary
