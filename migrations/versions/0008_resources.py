"""Resources: jobs.devices, the devices (trainer ranks) a job runs on; a worker takes only jobs that fit

Revision ID: 0008_resources
Revises: 0007_tools
"""

import sqlalchemy as sa
from alembic import op

revision = "0008_resources"
down_revision = "0007_tools"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("devices", sa.Integer(), nullable=False, server_default="1"))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("devices")
