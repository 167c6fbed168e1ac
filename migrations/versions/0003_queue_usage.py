"""Fair scheduling and usage: jobs' wall-clock limit and usage totals; usage_records per run and period

Revision ID: 0003_queue
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003_queue"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("max_wall_seconds", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("device_seconds", sa.Float(), server_default="0", nullable=False))
        batch.add_column(sa.Column("tokens_sampled", sa.BigInteger(), server_default="0", nullable=False))
        batch.add_column(sa.Column("tokens_trained", sa.BigInteger(), server_default="0", nullable=False))
    op.create_table(
        "usage_records",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("run_id", sa.String(length=200), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("period_start", sa.DateTime(timezone=True), nullable=False),
        sa.Column("device_seconds", sa.Float(), nullable=False),
        sa.Column("tokens_sampled", sa.BigInteger(), nullable=False),
        sa.Column("tokens_trained", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("job_id", "run_id", "period_start", name="uq_usage_records_run_period"),
    )
    with op.batch_alter_table("usage_records") as batch:
        batch.create_index("ix_usage_records_tenant_period", ["tenant_id", "period_start"], unique=False)
        batch.create_index(batch.f("ix_usage_records_job_id"), ["job_id"], unique=False)


def downgrade() -> None:
    op.drop_table("usage_records")
    with op.batch_alter_table("jobs") as batch:
        for col in ("tokens_trained", "tokens_sampled", "device_seconds", "max_wall_seconds"):
            batch.drop_column(col)
