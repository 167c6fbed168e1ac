"""A Tinker session whose worker died or stopped: its unfinished requests fail, and its models' last saved state."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import ColumnElement, or_, select, update
from sqlalchemy.orm import Session

from store.models import TinkerRequest, TinkerSession, utcnow

#: What a request the session's worker did not finish answers (the SDK raises it as ``RequestFailedError``).
UNFINISHED = (
    "the worker holding this session {how} before this request finished, so it did not take effect: send it "
    "again. The session's models go on from their last saved state (save_state or load_state) at their next "
    "call, which fails saying so if calls made after that state were lost; a model with no saved state fails "
    "its calls"
)
#: The calls whose effect lives only in the worker's memory until a ``save_state``.
STATEFUL = ("forward_backward", "optim_step")


def _lose(s: Session, held: ColumnElement[bool], how: str) -> list[str]:
    """Free the active sessions ``held`` selects (a condition on their lease) and fail their unfinished requests;
    one guarded update, so a lease renewed meanwhile is not taken."""
    lost = list(
        s.scalars(
            update(TinkerSession)
            .where(TinkerSession.status == "active", held)
            .values(lease_owner=None, lease_expires_at=None)
            .returning(TinkerSession.id)
            .execution_options(synchronize_session=False)
        )
    )
    if lost:
        s.execute(
            update(TinkerRequest)
            .where(TinkerRequest.session_id.in_(lost), TinkerRequest.status.in_(("pending", "running")))
            .values(status="failed", error=UNFINISHED.format(how=how), error_category="server", finished_at=utcnow())
            .execution_options(synchronize_session=False)
        )
    s.commit()
    return lost


def reap_lost(s: Session) -> list[str]:
    """The sessions whose worker's lease ran out (it died): freed for another worker, their unfinished requests
    failed (queued before the session was freed, they would otherwise run on its restored state unasked)."""
    expired = (TinkerSession.lease_owner.is_not(None)) & (TinkerSession.lease_expires_at < utcnow())
    return _lose(s, expired, "died")


def hand_back(s: Session, worker: str) -> list[str]:
    """A stopping worker's sessions, handed back as a dead worker's are: its models leave with it."""
    return _lose(s, TinkerSession.lease_owner == worker, "stopped")


def not_held(s: Session, worker: str, session_ids: list[str]) -> list[str]:
    """Those of ``session_ids`` that ``worker`` no longer holds (closed, or reaped and maybe taken by another):
    the models it keeps of them are stale."""
    if not session_ids:
        return []
    gone = or_(TinkerSession.status != "active", TinkerSession.lease_owner.is_(None))
    gone = or_(gone, TinkerSession.lease_owner != worker)
    return list(s.scalars(select(TinkerSession.id).where(TinkerSession.id.in_(session_ids), gone)))


@dataclass(frozen=True)
class ResumePoint:
    """Where a training model no worker holds goes on from: the last state it saved or loaded (None: none since
    it was made), and how many of its ``forward_backward`` / ``optim_step`` calls that state lacks."""

    path: str | None
    optimizer: bool
    behind: int


def resume_point(s: Session, model_id: str) -> ResumePoint:
    """The model's last ``save_weights`` of its training state or ``load_weights``, from its request log; with
    neither, the model as it was made (its base model and LoRA seed), exact while ``behind`` is 0."""
    saved = select(TinkerRequest).where(
        TinkerRequest.model_id == model_id,
        TinkerRequest.status == "done",
        TinkerRequest.kind.in_(("save_weights", "load_weights")),
    )
    for row in s.scalars(saved.order_by(TinkerRequest.finished_at.desc(), TinkerRequest.id.desc())):
        if row.kind == "load_weights" or row.payload.get("kind") == "training":
            optimizer = row.kind == "save_weights" or bool(row.payload.get("optimizer"))
            behind = _behind(s, model_id, row.finished_at)
            return ResumePoint(row.payload["path"], optimizer, behind)
    return ResumePoint(None, False, _behind(s, model_id, None))


def _behind(s: Session, model_id: str, saved_at: datetime | None) -> int:
    """The state-changing calls done after ``saved_at``, and the gradients accumulated before it since the last
    optimizer step (a saved state holds weights and optimizer, not gradients)."""
    calls = s.execute(
        select(TinkerRequest.kind, TinkerRequest.finished_at)
        .where(TinkerRequest.model_id == model_id, TinkerRequest.status == "done", TinkerRequest.kind.in_(STATEFUL))
        .order_by(TinkerRequest.finished_at.desc(), TinkerRequest.id.desc())
    )
    behind = 0
    for kind, finished_at in calls:
        if saved_at is None or finished_at is None or finished_at > saved_at:
            behind += 1
        elif kind == "optim_step":
            break
        else:
            behind += 1
    return behind
