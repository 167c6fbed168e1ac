"""jobs.latest_metrics: the newest step's metrics on the job row

Status polls read the job alone instead of also querying step_metrics (and a job list of N jobs
no longer runs N extra queries).

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("latest_metrics", sa.JSON(), nullable=True))
    op.execute(
        "UPDATE jobs SET latest_metrics = (SELECT m.metrics FROM step_metrics m WHERE m.job_id = jobs.id "
        "ORDER BY m.step DESC LIMIT 1)"
    )


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("latest_metrics")
