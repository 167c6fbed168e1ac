"""Deletion: a job keeps its history when its files are deleted; pending object deletions

jobs.training_file_id / validation_file_id become ON DELETE SET NULL (training_file_id nullable), so
a file that only finished jobs used can be deleted; pending_deletions lists stored objects whose rows
were deleted, until the objects are removed too.

Revision ID: 0004_apilimits
Revises: 0003_queue
"""

import sqlalchemy as sa
from alembic import op

revision = "0004_apilimits"
down_revision = "0003_queue"
branch_labels = None
depends_on = None

_FKS = (("training_file_id", "jobs_training_file_id_fkey"), ("validation_file_id", "jobs_validation_file_id_fkey"))


def _refk(ondelete: str | None, nullable: bool) -> None:
    """Recreate the two file FKs of jobs with ``ondelete``. SQLite's are unnamed: the batch copy of
    the table is given them by name, and the reflected ones are dropped with the old table."""
    if op.get_bind().dialect.name == "sqlite":
        naming = {"fk": "%(table_name)s_%(column_0_name)s_fkey"}
        with op.batch_alter_table("jobs", recreate="always", naming_convention=naming) as batch:
            for column, name in _FKS:
                batch.drop_constraint(name, type_="foreignkey")
                batch.create_foreign_key(name, "files", [column], ["id"], ondelete=ondelete)
            batch.alter_column("training_file_id", existing_type=sa.String(40), nullable=nullable)
        return
    for column, name in _FKS:
        op.drop_constraint(name, "jobs", type_="foreignkey")
        op.create_foreign_key(name, "jobs", "files", [column], ["id"], ondelete=ondelete)
    op.alter_column("jobs", "training_file_id", existing_type=sa.String(40), nullable=nullable)


def upgrade() -> None:
    _refk("SET NULL", True)
    op.create_table(
        "pending_deletions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("prefix", sa.String(length=512), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )


def downgrade() -> None:
    op.drop_table("pending_deletions")
    orphaned = "SELECT id FROM jobs WHERE training_file_id IS NULL"  # cannot go back to NOT NULL with them
    for table in ("job_events", "step_metrics", "samples", "checkpoints"):
        op.execute(f"DELETE FROM {table} WHERE job_id IN ({orphaned})")
    op.execute("DELETE FROM jobs WHERE training_file_id IS NULL")
    _refk(None, False)
