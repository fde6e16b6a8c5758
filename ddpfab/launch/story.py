"""The failure's story as the user reads it: the live line when a node fails, the line per other
node, and the closing line. Pure: outcomes and the blame (:func:`ddpfab.launch.cause.blame`) in,
text out; the monitor (:mod:`ddpfab.launch.execute`) prints it.

The rule: name the rank that failed on its own, with its node, global and local rank and its error
line; count the victims (ranks that lost their peer, ranks that were stopped), never name one as
the cause.
"""

from __future__ import annotations

from dataclasses import replace
from collections.abc import Mapping
from typing import Protocol

from ddpfab.hostlist import FOLD_ABOVE, compact
from ddpfab.launch.cause import Blame, Cause, CauseKind, CauseReader

#: Other nodes whose rank failed on its own (another way) named in the closing line; the rest counted.
ALSO_SHOWN = 3
#: Where a rank ended (exit 0) while the others still waited for it in a collective.
ENDS_EARLY = "look there for a rank that ends before the others"


class Outcome(Protocol):
    """What the story reads of a node's outcome (:class:`ddpfab.launch.execute.NodeOutcome`)."""

    node_rank: int
    exit_code: int | None
    error: str | None
    stopped_by_ddpfab: bool
    cause: Cause | None
    remote: dict | None  # its supervisor's record
    causes: CauseReader  # what its output said


def why(out: Outcome) -> str:
    """``exit code 1``, or the node's error (lost, no exit status)."""
    return out.error or f"exit code {out.exit_code}"


def peer_text(cause: Cause, addresses: dict[str, str]) -> str:
    """`` (its peer: node2)``, the node whose address the victim's error names, or ""."""
    if not cause.peer:
        return ""
    node = next((name for name, addr in addresses.items() if addr == cause.peer), None)
    return f" (its peer: {node})" if node else f" (its peer: {cause.peer})"


def cause_text(cause: Cause, out: Outcome) -> str:
    """*cause*'s text, without its exit code where the node's own says it already."""
    return (replace(cause, exit_code=None) if cause.exit_code == out.exit_code else cause).text()


def live_line(name: str, out: Outcome, addresses: dict[str, str], settled: float | None = None) -> str:
    """The line when the monitor stops the others: the node, why, and its rank's cause; for a
    victim (*settled*: the seconds given to the others to report a failure of their own), that no
    rank failed on its own meanwhile."""
    cause = out.cause
    text = f"{name} (node_rank {out.node_rank}) failed ({why(out)}"
    if cause is not None and cause.own:
        return f"{text}; {cause_text(cause, out)}); stopping the other nodes"
    if cause is not None and cause.kind is CauseKind.PEER_LOST:
        text += f"; {cause.who() or 'a rank'} lost its peer{peer_text(cause, addresses)}"
    elif cause is not None:
        text += f"; {cause.text()}"
    waited = f"; no rank failed on its own within {settled:g} s" if settled is not None else ""
    return f"{text}{waited}); stopping the other nodes"


def node_story(out: Outcome, addresses: dict[str, str], with_ranks: bool = True) -> str:
    """One other node's part: ``rank 0 (local rank 0) lost its peer (its peer: node2)``, ``stopped
    by ddpfab``, ``exited 0``, its error; *with_ranks* False leaves the ranks and the peer out
    (for grouping)."""
    cause = out.cause
    if out.error and out.exit_code is None:
        return out.error
    if cause is not None and cause.kind is CauseKind.PEER_LOST:
        if not with_ranks:  # grouped: the victims of a ring name as many peers as there are nodes
            return "a rank lost its peer"
        return f"{cause.who() or 'a rank'} lost its peer{peer_text(cause, addresses)}"
    if cause is not None and cause.own:
        return cause.text() if with_ranks else f"failed too ({cause.kind.value if cause.kind else 'its own'})"
    if out.exit_code == 0:
        return "exited 0"
    if out.stopped_by_ddpfab:
        return "stopped by ddpfab"
    return why(out)


def other_nodes(outcomes: Mapping[str, Outcome], named: str | None, addresses: dict[str, str]) -> list[str]:
    """A line per node other than *named* (in inventory order); beyond FOLD_ABOVE, one per story."""
    others = {n: o for n, o in outcomes.items() if n != named}
    if len(others) <= FOLD_ABOVE:
        return [f"  {n} (node_rank {o.node_rank}): {node_story(o, addresses)}" for n, o in others.items()]
    by_story: dict[str, list[str]] = {}
    for n, o in others.items():
        by_story.setdefault(node_story(o, addresses, with_ranks=False), []).append(n)
    return [f"  {compact(names)}: {story}" for story, names in by_story.items()]


def closing_line(verdict: Blame, out: Outcome, fallback: str, addresses: dict[str, str],
                 outcomes: Mapping[str, Outcome] | None = None) -> str:
    """``failed: node2 (node_rank 1) exit code 1; rank 1 (local rank 0), exit code 1: ValueError:
    ...; 2 other ranks lost their peer; the others were stopped``. *out*: the named node's outcome;
    *fallback*: what to say of its rank when its output named none (the supervisor's record);
    *outcomes*: every node's, to say what the others did (exited 0 already, or were stopped)."""
    parts = [f"failed: {verdict.node} (node_rank {out.node_rank}) {why(out)}"]
    cause = verdict.cause
    others = {n: o for n, o in (outcomes or {}).items() if n != verdict.node}
    early = ended_early(verdict, others)
    if cause is not None and (cause.own or cause.kind is None):
        parts.append(cause_text(cause, out))
        if out.causes.restarted and cause.own:
            parts.append("torchrun's restarts after it (--max-restarts) failed too")
        if here := own_beside(out, cause):  # another rank of the node failed on its own at once, another way
            parts.append(f"also on {verdict.node}: {here}")
    elif cause is not None:
        lost = f"{cause.who() or 'a rank'} lost its peer{peer_text(cause, addresses)}" \
            if cause.kind is CauseKind.PEER_LOST else cause.text()
        lead = leading(verdict, others)
        if early is not None:  # the node the victims wait for had ended: it leads, the first victim after it
            parts = [f"failed: {early} (node_rank {others[early].node_rank}) exited 0 while the others still "
                     f"waited for it ({addresses[early]}, named by their errors): {ENDS_EARLY}",
                     f"then {verdict.node} (node_rank {out.node_rank}) {why(out)}: {lost}"]
        elif lead is not None:  # where the victims point, a node not all of whose ranks lost their peer
            left = ended_0_text(others[lead])
            parts = [f"failed: {lead} (node_rank {others[lead].node_rank}) {why(others[lead])}, where the others' "
                     f"errors point ({addresses.get(lead, lead)}): "
                     + (f"{left} while the others still waited: {ENDS_EARLY}"
                        if left else "not all its ranks lost their peer, and none said why it failed: look there first"),
                     f"first to end: {verdict.node} (node_rank {out.node_rank}) {why(out)}: {lost}"]
        elif (left := ended_0_text(out)) and verdict.pointed in (None, verdict.node):
            parts.append(f"{left} while the others still waited: {ENDS_EARLY}; then {lost}")
        else:
            parts.append(f"only secondary failures were seen: {lost}{_pointed(verdict, addresses, others)}")
    elif fallback:
        parts.append(fallback)
    same = [n for n, o in others.items() if o.cause is not None and o.cause.same_failure(cause)]
    if same:  # every rank the same error (a usage error, an import): one story, told once
        parts.append(f"{compact(same)} failed the same way")
    also = {n: o for n, o in others.items() if n not in same and o.cause is not None and o.cause.own
            and o.exit_code not in (None, 0)}
    if also:  # another rank's own failure, of another kind: never counted with the stopped
        parts.append(f"also on its own: {also_text(also)}")
    if verdict.victims():
        parts.append(verdict.victims())
    done = [n for n, o in others.items() if o.exit_code == 0 and n != early]
    if done:
        parts.append(f"{compact(done)} exited 0")
    told = set(done) | set(same) | set(also) | {early}
    stopped = [n for n, o in others.items() if n not in told and o.stopped_by_ddpfab
               and not (o.cause is not None and o.cause.kind is CauseKind.PEER_LOST)]  # (victims are counted)
    if outcomes is None or (stopped and len(stopped) == len(others) - len(told & set(others))):
        parts.append("the others were stopped")
    elif stopped:
        parts.append(f"{compact(stopped)} {'was' if len(stopped) == 1 else 'were'} stopped")
    return "; ".join(parts)


def also_text(also: Mapping[str, Outcome]) -> str:
    """``node3 (node_rank 2) rank 4 (local rank 0): KeyError: 'step'``, for the other nodes whose
    rank failed on its own, another way (the first :data:`ALSO_SHOWN`; the rest counted)."""
    shown = [f"{n} (node_rank {o.node_rank}) {cause_text(o.cause, o)}" for n, o in list(also.items())[:ALSO_SHOWN]
             if o.cause is not None]
    more = len(also) - len(shown)
    return ", ".join(shown) + (f" and {more} more node{'s' * (more != 1)}" if more else "")


def own_beside(out: Outcome, cause: Cause) -> str:
    """``rank 3 (local rank 1): KeyError: 'step'``: the other ranks of *out*'s node that failed on
    their own, another way than *cause* (the one named): two ranks' errors at once, before torchrun
    stopped the rest; "" when none. Their global ranks follow from *cause*'s (torchrun numbers a
    node's ranks in a row)."""
    if not cause.own or cause.local_rank is None or out.causes.restarted:
        return ""  # (after torchrun's restarts the others' errors are of later attempts, in its wake)
    found = []
    for local in out.causes.order:
        other = out.causes.rank_cause(local)
        if other is None or local == cause.local_rank or not other.own or other.same_failure(cause):
            continue
        rank = cause.rank - cause.local_rank + local if cause.rank is not None else None
        rank = rank if rank is not None and rank >= 0 else None
        found.append(replace(other, rank=rank).text())
    more = len(found) - ALSO_SHOWN
    return ", ".join(found[:ALSO_SHOWN]) + (f" and {more} more" if more > 0 else "")


def ended_0_text(out: Outcome) -> str | None:
    """``rank 3 (local rank 1) exited 0`` for the ranks of a failed node that had ended their work
    before (its supervisor's ``ended_0``, read as data), or None."""
    ended = (out.remote or {}).get("ended_0") if isinstance(out.remote, dict) else None
    ranks = [f"rank {r['rank']} (local rank {r['local_rank']})" for r in ended
             if isinstance(r, dict) and type(r.get("rank")) is int and type(r.get("local_rank")) is int] \
        if isinstance(ended, list) else []
    shown = ", ".join(ranks[:ALSO_SHOWN]) + (f" and {len(ranks) - ALSO_SHOWN} more" if len(ranks) > ALSO_SHOWN else "")
    return f"{shown} exited 0" if ranks else None


def leading(verdict: Blame, others: Mapping[str, Outcome]) -> str | None:
    """The node that leads the closing line instead of the one named first, when no rank failed
    on its own: the node the victims wait for, had it ended early (:func:`ended_early`), else the
    node their errors point at when it is no victim as a whole and failed before any stop (a rank
    of it failed unseen: ended by torchrun before it said why); None when the node named leads."""
    node = verdict.pointed
    if ended_early(verdict, others) is not None:
        return node
    if node and node in others and verdict.pointed_alone and verdict.cause is not None and not verdict.cause.own \
            and others[node].exit_code != 0 and not others[node].stopped_by_ddpfab:
        return node
    return None


def ended_early(verdict: Blame, others: Mapping[str, Outcome]) -> str | None:
    """The node the victims' errors name when it had exited 0 while they waited for it in a
    collective (a rank of it ended early): the story's first node; else None."""
    node = verdict.pointed
    return node if node and node in others and others[node].exit_code == 0 and verdict.cause is not None \
        and not verdict.cause.own else None


def _pointed(verdict: Blame, addresses: dict[str, str], others: Mapping[str, Outcome]) -> str:
    """Where the victims' errors point: the node they name (one that had ended early leads the
    line instead: :func:`ended_early`)."""
    node = verdict.pointed
    if not node or node not in addresses:
        return ""
    return f"; their errors name {node} ({addresses[node]}): look there first"


def signal_hint(cause: Cause | None, node: str, launcher: int | None = None, no_oom: bool = False) -> str | None:
    """What sends SIGKILL, when one killed the rank named (or, with no rank's cause, torchrun
    itself: *launcher*, the signal its supervisor recorded) and the node recorded no OOM kill of
    it (*no_oom*: its supervisor read the kernel log, which has none; else the log may be closed
    to ddpfab's user); where a SIGTERM from outside the run came from; None for any other cause."""
    killed = cause.signal if cause is not None and cause.kind is CauseKind.SIGNAL else \
        launcher if cause is None else None
    if killed == 15:
        return (f"neither ddpfab nor torchrun sent the first SIGTERM on {node}: it came from outside the run (someone's "
                "`kill` or `pkill`, a scheduler or watchdog, a shutdown), to the rank or to torchrun, which ends its "
                "ranks with it")
    if killed != 9:
        return None
    if no_oom:
        return (f"no OOM kill of it is in {node}'s kernel log, so not the kernel's OOM killer: SIGKILL then comes "
                "from a user-space OOM daemon (systemd-oomd, earlyoom), a scheduler or watchdog, or someone's `kill -9`")
    return (f"SIGKILL comes from the kernel's OOM killer (no record of it was found, but {node}'s kernel log may "
            f"be closed to this user: `dmesg | grep -i kill` there as root), a memory limit (cgroup, ulimit), a "
            "scheduler or watchdog, or someone's `kill -9`")
