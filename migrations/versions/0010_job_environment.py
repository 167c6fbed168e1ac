"""Environments and before/after evaluation: jobs.environment (where prompts and rewards come from instead of
files) and jobs.evaluation (the held-out evaluation before the first step and after the last)

Revision ID: 0010_job_environment
Revises: 0009_webhook_rotation
"""

import sqlalchemy as sa
from alembic import op

revision = "0010_job_environment"
down_revision = "0009_webhook_rotation"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("environment", sa.JSON(), nullable=True))
    op.add_column("jobs", sa.Column("evaluation", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("evaluation")
        batch.drop_column("environment")
