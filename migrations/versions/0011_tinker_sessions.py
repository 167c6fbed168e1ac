"""Tinker-compatible sessions: tinker_sessions, tinker_models, tinker_checkpoints, tinker_requests (the futures)

Revision ID: 0011_tinker_sessions
Revises: 0010_job_environment
"""

import sqlalchemy as sa
from alembic import op

revision = "0011_tinker_sessions"
down_revision = "0010_job_environment"
branch_labels = None
depends_on = None


def _tenant() -> sa.Column:
    return sa.Column("tenant_id", sa.String(40), sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False)


def _when(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "tinker_sessions",
        sa.Column("id", sa.String(40), primary_key=True),
        _tenant(),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("tags", sa.JSON(), nullable=False),
        _when("created_at"),
        _when("heartbeat_at"),
        sa.Column("lease_owner", sa.String(200), nullable=True),
        _when("lease_expires_at", nullable=True),
        sa.Column("closed_reason", sa.Text(), nullable=True),
    )
    op.create_index("ix_tinker_sessions_tenant_id", "tinker_sessions", ["tenant_id"])
    op.create_table(
        "tinker_models",
        sa.Column("id", sa.String(40), primary_key=True),
        _tenant(),
        sa.Column("session_id", sa.String(40), sa.ForeignKey("tinker_sessions.id", ondelete="CASCADE"), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("base_model", sa.String(512), nullable=False),
        sa.Column("model_path", sa.String(512), nullable=True),
        sa.Column("lora", sa.JSON(), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        _when("created_at"),
        _when("last_request_at"),
    )
    op.create_index("ix_tinker_models_tenant_id", "tinker_models", ["tenant_id"])
    op.create_index("ix_tinker_models_session_id", "tinker_models", ["session_id"])
    op.create_table(
        "tinker_checkpoints",
        sa.Column("id", sa.String(40), primary_key=True),
        _tenant(),
        sa.Column("model_id", sa.String(40), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("directory", sa.String(1024), nullable=False),
        sa.Column("object_prefix", sa.String(512), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        _when("created_at"),
        sa.UniqueConstraint("model_id", "kind", "name", name="uq_tinker_checkpoints_name"),
    )
    op.create_index("ix_tinker_checkpoints_tenant_id", "tinker_checkpoints", ["tenant_id"])
    op.create_index("ix_tinker_checkpoints_model_id", "tinker_checkpoints", ["model_id"])
    op.create_table(
        "tinker_requests",
        sa.Column("id", sa.String(40), primary_key=True),
        _tenant(),
        sa.Column("session_id", sa.String(40), sa.ForeignKey("tinker_sessions.id", ondelete="CASCADE"), nullable=False),
        sa.Column("model_id", sa.String(40), nullable=True),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("error_category", sa.String(16), nullable=True),
        _when("created_at"),
        _when("finished_at", nullable=True),
    )
    op.create_index("ix_tinker_requests_tenant_id", "tinker_requests", ["tenant_id"])
    op.create_index("ix_tinker_requests_session_status", "tinker_requests", ["session_id", "status", "created_at"])


def downgrade() -> None:
    op.drop_table("tinker_requests")
    op.drop_table("tinker_checkpoints")
    op.drop_table("tinker_models")
    op.drop_table("tinker_sessions")
