"""Tools of a job: jobs.tools (a JSON list of tool specs; NULL = none, as for every earlier job)

Revision ID: 0007_tools
Revises: 0006_pause
"""

import sqlalchemy as sa
from alembic import op

revision = "0007_tools"
down_revision = "0006_pause"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("tools", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("tools")
