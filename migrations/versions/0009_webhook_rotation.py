"""Webhook endpoints change: updated_at, and the previous signing secret kept for a while after a rotation

Revision ID: 0009_webhook_rotation
Revises: 0008_resources
"""

import sqlalchemy as sa
from alembic import op

revision = "0009_webhook_rotation"
down_revision = "0008_resources"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("webhook_endpoints") as batch:
        batch.add_column(sa.Column("updated_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("previous_secret", sa.String(100), nullable=True))
        batch.add_column(sa.Column("previous_secret_until", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("webhook_endpoints") as batch:
        batch.drop_column("previous_secret_until")
        batch.drop_column("previous_secret")
        batch.drop_column("updated_at")
