"""``ccld diagnose DIR``: the live diagnoser's analysis over the boards of a job that is gone.

Each board becomes the summary its agent would have published at the rank's last sign of
life (``agent.board_summary``, the function the agent uses), all on the diagnoser's clock;
the job's "now" is the latest of them, so who stopped or died first is judged from the
boards relative to each other, not relative to the moment of the post-mortem. One round of
the same :class:`Analyzer` gives the same verdict records.
"""

from __future__ import annotations

import os
import stat
from datetime import datetime, timezone
from pathlib import Path

from ccld_plugin.agent.board_summary import arrival_samples, samples_per_group, summarize_board
from ccld_plugin.board.job_files import JOB_CONFIG
from ccld_plugin.board.process import process_alive
from ccld_plugin.config import CcldConfig, load_config
from ccld_plugin.diagnose import Analyzer, JobView, Verdict
from ccld_plugin.diagnose.analyzer import located_by_channels
from ccld_plugin.diagnose.records import Culprit
from ccld_plugin.diagnose.stalls.crash import peer_failure
from ccld_plugin.files import kind_of, os_problem
from ccld_plugin.postmortem.boards import JobBoards, PostmortemError, RankBoard
from ccld_plugin.probes.nccl_channels import NcclChannels
from ccld_plugin.wire.codes import STATE_DONE
from ccld_plugin.wire.peer_channels import MAX_ENTRIES, encode_channels, entry_order
from ccld_plugin.wire.summary import FLAG_CRASHED, RankSummary

__all__ = ["diagnose_boards", "job_config", "job_view", "saved_config", "stamp"]

# A rank whose last sign of life is this many agent ticks before the job's last is the one
# that died (or froze) first: ranks that ran until the job was killed stop within a tick of
# each other.
STALE_TICKS = 2


def job_config(path: Path, config: Path | None, overrides: list[str]) -> CcldConfig:
    """``config``, else the configuration the job ran with (written beside its boards by
    the diagnoser rank), else the defaults; ``overrides`` on top."""
    return load_config(config or saved_config(path), overrides, writing=False)


def saved_config(path: Path) -> Path | None:
    """The job's config beside the boards at ``path`` (a folder or a board), if one is
    there. Anything there that is not a regular file (a FIFO would block the read), or
    that cannot be looked at, is refused: a diagnosis with other thresholds than the
    job's would not be the job's."""
    try:
        folder = path if stat.S_ISDIR(os.stat(path).st_mode) else path.parent
    except OSError:
        folder = path.parent
    saved = folder / JOB_CONFIG
    fix = "the job's config is read from there: remove it, or pass --config FILE"
    try:
        mode = os.stat(saved).st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise PostmortemError(f"{os_problem(saved, exc, 'looked at')}; {fix}") from None
    if not stat.S_ISREG(mode):
        raise PostmortemError(f"{saved}: {kind_of(mode)}, not a regular file; {fix}")
    return saved


def _summary(b: RankBoard, interval_s: float, world: int) -> RankSummary:
    h = b.snap.header
    seen = b.last_seen_ns()
    # since 0: every op the ring still holds counts, so the adaptive hang threshold sees
    # the group's op durations as the live rounds did.
    s = summarize_board(b.snap, seen, 0, b.offset_ns, groups_version=1, exited=h.closed)
    # The ring's collectives, sampled as the agent samples a tick's: joined across ranks,
    # they are each group's recent collectives (a pair's mismatch goes by them).
    ops = b.snap.ops
    s.samples = arrival_samples(ops[ops["state"] == STATE_DONE], samples_per_group(world), b.diag)
    s.stack = b.stack
    if h.closed and b.crash:
        s.flags |= FLAG_CRASHED
        s.stack = b.crash
    entries = NcclChannels().sample(b.channels, seen)
    if entries:
        entries.sort(key=entry_order)
        s.channels = encode_channels(
            entries[:MAX_ENTRIES], interval_s, sum(e.conns for e in entries)
        )
    return s


def job_view(boards: JobBoards, cfg: CcldConfig) -> JobView:
    interval_s = cfg.agent.interval_s
    failures = {r: b.diag(t) for r, b in boards.ranks.items() if (t := b.failed_ns()) is not None}
    ranks = boards.ranks
    implicated = _implicated(ranks, set(failures))
    first = min(failures, key=lambda r: (failures[r], r)) if failures else None
    if first is not None and not _raised_on_its_own(ranks[first]):
        # judged at the first failure: see RankBoard.as_of
        ranks = {r: b.as_of(failures[first]) for r, b in ranks.items()}
    summaries = {r: _summary(b, interval_s, boards.world) for r, b in ranks.items()}
    now = max(s.heartbeat_ns for s in summaries.values())
    return JobView(
        summaries=summaries,
        tables={r: b.groups for r, b in ranks.items()},
        now_ns=now,
        final=True,
        job_start_ns=min(b.diag(b.snap.header.start_mono_ns) for b in ranks.values()),
        world=boards.world,
        gone={
            r
            for r, s in summaries.items()
            if _died_first(s, ranks[r], now, r in failures, r in implicated, interval_s)
        },
    )


def _implicated(ranks: dict[int, RankBoard], raised: set[int]) -> set[int]:
    """The ranks whose connections broke under an op that raised: where the job failed.
    An op with one peer that did not raise itself (a transfer, a pair's collective) names
    it; where such ops exist, an op over a larger group (a world all-reduce that raised
    after the first failure) would add its bystanders, which the launcher ended later."""
    each = [b.failed_with() - raised for b in ranks.values()]
    exact = [peers for peers in each if len(peers) == 1]
    return set().union(*(exact or each))


def _raised_on_its_own(b: RankBoard) -> bool:
    """Whether the rank left on the exception its op raised, and not for a peer's failure
    or a timeout (a collective called with bad arguments): the job failed there, and is
    judged as it ended, with that rank's crash (diagnose.stalls.crash)."""
    return bool(b.crash) and not peer_failure(b.crash[-1])


def _died_first(
    s: RankSummary,
    b: RankBoard,
    now_ns: int,
    raised: bool,
    implicated: bool,
    interval_s: float,
) -> bool:
    """A rank whose process ended without our exit path before the job did: its last sign
    of life is ticks before the others' (they ran on, then waited for it), or, in a job
    where collectives raised (gloo raises when a peer's connection closes), before the
    first of them, while none of its own did and an op that did was with it (a rank the
    launcher ended afterwards, blocked in an op with nobody's failure, is not)."""
    if s.exited or process_alive(s.pid, b.snap.header.host) is True:
        return False
    stale = now_ns - s.heartbeat_ns > STALE_TICKS * interval_s * 1e9
    return stale or (implicated and not raised and s.heartbeat_ns < now_ns)


def failed_beyond(boards: JobBoards) -> tuple[list[int], list[int]]:
    """The ranks whose collectives raised, and the members of those ops that left no board
    here and raised nothing that was read (a rank's board is removed at a clean exit, and
    a job of several hosts keeps each host's boards on that host): where a job whose
    boards give no verdict failed."""
    raised = {r for r, b in boards.ranks.items() if b.failed_ns() is not None}
    implicated = _implicated(boards.ranks, raised)
    beyond = {r for r in implicated if 0 <= r < boards.world and r not in boards.ranks}
    return sorted(raised), sorted(beyond)


def diagnose_boards(boards: JobBoards, cfg: CcldConfig) -> list[Verdict]:
    """The verdicts one diagnoser round gives on the boards, stamped with the job's name,
    the wall-clock time of the boards' "now" (by the first board's clock) and the hosts
    the boards were written on (a board keeps no local rank nor device)."""
    analyzer = Analyzer(cfg.diagnoser, cfg.agent.interval_s, channel_evidence=located_by_channels)
    view = job_view(boards, cfg)
    verdicts = analyzer.round(view)
    first = boards.ranks[min(boards.ranks)].snap.header if boards.ranks else None
    when = None
    if first is not None:
        wall_ns = first.start_wall_ns + view.now_ns - (first.start_mono_ns - first.clock_offset_ns)
        try:
            when = datetime.fromtimestamp(wall_ns / 1e9, timezone.utc)
        except (OverflowError, ValueError, OSError):  # a corrupt board's start: not known
            when = None
    stamp(verdicts, view, boards.job or None, when)
    return verdicts


def stamp(verdicts: list[Verdict], view: JobView, job: str | None, when: datetime | None) -> None:
    """Who and where of the verdicts of a round over ``view``, as far as it tells: the
    culprits' hosts from their summaries."""
    for v in verdicts:
        v.stamp(job, view.job_start_ns, when, lambda r: Culprit(r, host=_host(view, r)))


def _host(view: JobView, rank: int) -> str | None:
    s = view.summaries.get(rank)
    return s.host if s is not None and s.host else None
