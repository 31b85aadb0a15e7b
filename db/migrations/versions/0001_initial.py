"""Initial schema: sweeps, environments, models, method specs, tasks, protocols, generation settings
and one row per sample result (unique on the cell key).

Revision ID: 0001
Revises: (none)
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "environments",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("spec_hash", sa.String(length=64), nullable=False),
        sa.Column("hostname", sa.String(length=255), nullable=False),
        sa.Column("platform", sa.String(length=255), nullable=False),
        sa.Column("python_version", sa.String(length=64), nullable=False),
        sa.Column("torch_version", sa.String(length=64), nullable=False),
        sa.Column("transformers_version", sa.String(length=64), nullable=False),
        sa.Column("cuda_version", sa.String(length=64), nullable=False),
        sa.Column("gpu_name", sa.String(length=255), nullable=False),
        sa.Column("gpu_count", sa.Integer(), nullable=False),
        sa.Column("kvleague_version", sa.String(length=64), nullable=False),
        sa.Column("ray_version", sa.String(length=64), nullable=False),
        sa.Column("git_commit", sa.String(length=64), nullable=False),
        sa.Column("git_dirty", sa.Boolean(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_environments")),
        sa.UniqueConstraint("spec_hash", name=op.f("uq_environments_spec_hash")),
    )
    op.create_table(
        "generation_settings",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("spec_hash", sa.String(length=64), nullable=False),
        sa.Column("max_new_tokens", sa.Integer(), nullable=False),
        sa.Column("temperature", sa.Float(), nullable=False),
        sa.Column("top_p", sa.Float(), nullable=False),
        sa.Column("stop", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_generation_settings")),
        sa.UniqueConstraint("spec_hash", name=op.f("uq_generation_settings_spec_hash")),
    )
    op.create_table(
        "method_specs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("spec_hash", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("params_json", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_method_specs")),
        sa.UniqueConstraint("spec_hash", name=op.f("uq_method_specs_spec_hash")),
    )
    with op.batch_alter_table("method_specs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_method_specs_name"), ["name"], unique=False)

    op.create_table(
        "models",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("spec_hash", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("revision", sa.String(length=255), nullable=True),
        sa.Column("dtype", sa.String(length=32), nullable=False),
        sa.Column("attn_implementation", sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_models")),
        sa.UniqueConstraint("spec_hash", name=op.f("uq_models_spec_hash")),
    )
    with op.batch_alter_table("models", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_models_name"), ["name"], unique=False)

    op.create_table(
        "protocols",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("spec_hash", sa.String(length=64), nullable=False),
        sa.Column("cadence", sa.String(length=64), nullable=False),
        sa.Column("positions", sa.String(length=32), nullable=False),
        sa.Column("sink", sa.Integer(), nullable=False),
        sa.Column("recent", sa.Integer(), nullable=False),
        sa.Column("protect_prompt", sa.Boolean(), nullable=False),
        sa.Column("prefill_chunk", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_protocols")),
        sa.UniqueConstraint("spec_hash", name=op.f("uq_protocols_spec_hash")),
    )
    op.create_table(
        "tasks",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("spec_hash", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("domain", sa.String(length=32), nullable=False),
        sa.Column("options", sa.JSON(), nullable=False),
        sa.Column("dataset", sa.String(length=255), nullable=True),
        sa.Column("source", sa.Text(), nullable=True),
        sa.Column("revision", sa.String(length=255), nullable=True),
        sa.Column("scorer_version", sa.String(length=64), nullable=False),
        sa.Column("metric", sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tasks")),
        sa.UniqueConstraint("spec_hash", name=op.f("uq_tasks_spec_hash")),
    )
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_tasks_domain"), ["domain"], unique=False)
        batch_op.create_index(batch_op.f("ix_tasks_name"), ["name"], unique=False)

    op.create_table(
        "sweeps",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("config_hash", sa.String(length=64), nullable=False),
        sa.Column("config_path", sa.Text(), nullable=True),
        sa.Column("git_commit", sa.String(length=64), nullable=False),
        sa.Column("git_dirty", sa.Boolean(), nullable=True),
        sa.Column("environment_id", sa.Integer(), nullable=False),
        sa.Column("ray_address", sa.String(length=255), nullable=True),
        sa.Column("ray_job_id", sa.String(length=255), nullable=True),
        sa.Column("status", sa.String(length=32), nullable=False),
        sa.Column("n_cells", sa.Integer(), nullable=False),
        sa.Column("n_skipped", sa.Integer(), nullable=False),
        sa.Column("n_ok", sa.Integer(), nullable=False),
        sa.Column("n_failed", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["environment_id"], ["environments.id"], name=op.f("fk_sweeps_environment_id_environments")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sweeps")),
    )
    with op.batch_alter_table("sweeps", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_sweeps_config_hash"), ["config_hash"], unique=False)
        batch_op.create_index(batch_op.f("ix_sweeps_name"), ["name"], unique=False)

    op.create_table(
        "sample_results",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("cell_key", sa.String(length=64), nullable=False),
        sa.Column("sweep_id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("method_spec_id", sa.Integer(), nullable=False),
        sa.Column("task_id", sa.Integer(), nullable=False),
        sa.Column("protocol_id", sa.Integer(), nullable=False),
        sa.Column("generation_id", sa.Integer(), nullable=False),
        sa.Column("environment_id", sa.Integer(), nullable=True),
        sa.Column("budget", sa.Integer(), nullable=False),
        sa.Column("sample_id", sa.String(length=255), nullable=False),
        sa.Column("sample_index", sa.Integer(), nullable=False),
        sa.Column("seed", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("correct", sa.Boolean(), nullable=True),
        sa.Column("score", sa.Float(), nullable=True),
        sa.Column("extracted", sa.Text(), nullable=True),
        sa.Column("completion", sa.Text(), nullable=True),
        sa.Column("stop_reason", sa.String(length=32), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("generated_tokens", sa.Integer(), nullable=True),
        sa.Column("prefill_seconds", sa.Float(), nullable=True),
        sa.Column("decode_seconds_mean", sa.Float(), nullable=True),
        sa.Column("decode_seconds_p50", sa.Float(), nullable=True),
        sa.Column("decode_seconds_p95", sa.Float(), nullable=True),
        sa.Column("tokens_per_second", sa.Float(), nullable=True),
        sa.Column("method_seconds", sa.Float(), nullable=True),
        sa.Column("wall_seconds", sa.Float(), nullable=True),
        sa.Column("evictions", sa.Integer(), nullable=True),
        sa.Column("evicted_tokens", sa.Integer(), nullable=True),
        sa.Column("peak_cache_entries", sa.Integer(), nullable=True),
        sa.Column("peak_kv_bytes", sa.BigInteger(), nullable=True),
        sa.Column("peak_memory_bytes", sa.BigInteger(), nullable=True),
        sa.Column("peak_memory_source", sa.String(length=64), nullable=True),
        sa.Column("attn_implementation", sa.String(length=64), nullable=True),
        sa.Column("details", sa.JSON(), nullable=True),
        sa.Column("worker", sa.String(length=255), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["environment_id"], ["environments.id"], name=op.f("fk_sample_results_environment_id_environments")
        ),
        sa.ForeignKeyConstraint(
            ["generation_id"],
            ["generation_settings.id"],
            name=op.f("fk_sample_results_generation_id_generation_settings"),
        ),
        sa.ForeignKeyConstraint(
            ["method_spec_id"], ["method_specs.id"], name=op.f("fk_sample_results_method_spec_id_method_specs")
        ),
        sa.ForeignKeyConstraint(["model_id"], ["models.id"], name=op.f("fk_sample_results_model_id_models")),
        sa.ForeignKeyConstraint(
            ["protocol_id"], ["protocols.id"], name=op.f("fk_sample_results_protocol_id_protocols")
        ),
        sa.ForeignKeyConstraint(["sweep_id"], ["sweeps.id"], name=op.f("fk_sample_results_sweep_id_sweeps")),
        sa.ForeignKeyConstraint(["task_id"], ["tasks.id"], name=op.f("fk_sample_results_task_id_tasks")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sample_results")),
        sa.UniqueConstraint("cell_key", name=op.f("uq_sample_results_cell_key")),
    )
    with op.batch_alter_table("sample_results", schema=None) as batch_op:
        batch_op.create_index(
            "ix_sample_results_leaderboard",
            ["model_id", "task_id", "protocol_id", "method_spec_id", "budget", "status"],
            unique=False,
        )
        batch_op.create_index("ix_sample_results_method_budget", ["method_spec_id", "budget"], unique=False)
        batch_op.create_index("ix_sample_results_status", ["status"], unique=False)
        batch_op.create_index(batch_op.f("ix_sample_results_sweep_id"), ["sweep_id"], unique=False)
        batch_op.create_index("ix_sample_results_task_budget", ["task_id", "budget"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("sample_results", schema=None) as batch_op:
        batch_op.drop_index("ix_sample_results_task_budget")
        batch_op.drop_index(batch_op.f("ix_sample_results_sweep_id"))
        batch_op.drop_index("ix_sample_results_status")
        batch_op.drop_index("ix_sample_results_method_budget")
        batch_op.drop_index("ix_sample_results_leaderboard")

    op.drop_table("sample_results")
    with op.batch_alter_table("sweeps", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_sweeps_name"))
        batch_op.drop_index(batch_op.f("ix_sweeps_config_hash"))

    op.drop_table("sweeps")
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_tasks_name"))
        batch_op.drop_index(batch_op.f("ix_tasks_domain"))

    op.drop_table("tasks")
    op.drop_table("protocols")
    with op.batch_alter_table("models", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_models_name"))

    op.drop_table("models")
    with op.batch_alter_table("method_specs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_method_specs_name"))

    op.drop_table("method_specs")
    op.drop_table("generation_settings")
    op.drop_table("environments")
