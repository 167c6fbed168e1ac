"""Pause and results files: files.purpose (fine-tune | fine-tune-results) and files.job_id

A finished job's metrics CSV is a file of its tenant (purpose fine-tune-results) that names its job,
at most one per job (a unique index: a retried write never makes two). Job statuses are strings: the
new ``pausing`` and ``paused`` need no schema change.

Revision ID: 0006_pause
Revises: 0005_webhooks
"""

import sqlalchemy as sa
from alembic import op

revision = "0006_pause"
down_revision = "0005_webhooks"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("files", sa.Column("purpose", sa.String(32), nullable=False, server_default="fine-tune"))
    op.add_column("files", sa.Column("job_id", sa.String(40), nullable=True))
    op.create_index("ix_files_job_id", "files", ["job_id"], unique=True)


def downgrade() -> None:
    op.drop_index("ix_files_job_id", table_name="files")
    with op.batch_alter_table("files") as batch:
        batch.drop_column("job_id")
        batch.drop_column("purpose")
