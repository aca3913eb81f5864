"""The GRPO job spec, whole: one pydantic model (:class:`JobSpec`, in ``job``) shared by the API
(validation) and the trainer (execution), its sections by topic (``base``: the shared bounds,
``dataset``, ``grpo``, ``adaptation``, ``agents``, ``integrations``, ``checkpoint``,
``model_source``, ``resources``), the validators they need (``row_budget``) and what each
registered name is beyond its name (``traits``).

Every section is a :class:`specbase.StrictModel`. The ``graders`` section is the union of grader
types, re-exported here from :mod:`grading.graders`, where each type's spec class sits beside
its runtime (one module each) with the bounded parsers of what tenants write in them
(templates, formulas, RE2 patterns, Python source). ``grading`` imports nothing of this package:
both stand on ``specbase``.

Beside the sections, the torch-free rules the API, the trainer and the workers share:

- ``grpo_options``: the ``grpo`` section's sub-sections (DAPO options, ``grpo.async``);
- ``kl``: the ``grpo.kl`` section and the traits of each KL estimator;
- ``async_warnings``: the warnings of an async spec whose update is not the on-policy one;
- ``rows``: one prompt row of a dataset, bounded;
- ``prompt_format``: how a job's conversations and tool calls are written for the model;
- ``model_shape``: a decoder's shape from its ``config.json`` and its parameter counts;
- ``memory_plan``: how much memory one device of a job holds;
- ``memory_terms``: the bytes of each term of that plan;
- ``paths``: which model and dataset folders a job may read (the operator's rule);
- ``checkpoint_files``: where checkpoints live, their file names, deleting and measuring them;
- ``tinker_losses``: the Tinker API's losses by name and the inputs each one reads.

This package is the one front door: ``from jobspec import JobSpec, GRPOSpec, ...``. It is
torch-free (the API imports it; an import contract checks) and imports nothing of the trainer.
"""

from __future__ import annotations

from grading.graders import (
    GRADER_SPECS,
    GRADER_TYPES,
    ExactMatchGrader,
    GraderSpec,
    GraderSpecBase,
    GraderSpecUnion,
    LengthGrader,
    MathGrader,
    MultiGrader,
    NumericMatchGrader,
    PythonGrader,
    RegexGrader,
    ScoreModelGrader,
    StringCheckGrader,
    TextSimilarityGrader,
    grader_name,
)
from grading.graders.length import MAX_LENGTH_CHARS
from grading.regex import MAX_PATTERN_CHARS, REGEX_MAX_MEM, compile_regex
from jobspec.adaptation import (
    ALL_LINEAR,
    LoraSpec,
    TrainingDtype,
)
from jobspec.agents import (
    MAX_TOOLS,
    EnvironmentSpec,
    EpisodeSpec,
    HttpEnvironment,
    HttpToolImplementation,
    PythonEnvironment,
    PythonToolImplementation,
    ToolFunction,
    ToolImplementation,
    ToolSpec,
)
from jobspec.base import (
    MAX_HOLDOUT_ROWS,
    MAX_INLINE_ROWS,
    MAX_SEED,
    MAX_STEPS,
    MAX_TEXT_CHARS,
    MAX_TOKENS,
)
from jobspec.checkpoint import (
    METRIC_NAME_PATTERN,
    BestMode,
    CheckpointSpec,
)
from jobspec.dataset import ArithmeticGenerator, DatasetSpec, SavedDataset
from jobspec.grpo import (
    CPU_ROLLOUT_DTYPE,
    MAX_COMPLETIONS_PER_UPDATE,
    MAX_STALENESS,
    AdvantageScale,
    AsyncSpec,
    DynamicSamplingSpec,
    EvalSpec,
    GRPOSpec,
    LossAggregation,
    OverlongSpec,
    RolloutEngineName,
    RolloutSpec,
    SamplerCorrectionMode,
    SamplerCorrectionSpec,
    UnresolvedMicroBatch,
    rollout_dtype,
)
from jobspec.integrations import (
    INTEGRATION_TYPES,
    IntegrationSpec,
    MlflowIntegration,
    WandbIntegration,
)
from jobspec.job import (
    PACKAGED_MODELS,
    InitFrom,
    JobSpec,
    spec_limits_violations,
)
from jobspec.kl import KLEstimatorName, KLPlacement, KLSpec
from jobspec.model_source import (
    is_hub_repo_id,
)
from jobspec.resources import MAX_DEVICES, ResourcesSpec
from jobspec.rows import ChatMessage, PromptRow, row_fields_problem
from specbase import StrictModel, literal_tag, text_problem

__all__ = [
    "ALL_LINEAR",
    "CPU_ROLLOUT_DTYPE",
    "GRADER_SPECS",
    "GRADER_TYPES",
    "INTEGRATION_TYPES",
    "MAX_COMPLETIONS_PER_UPDATE",
    "MAX_DEVICES",
    "MAX_HOLDOUT_ROWS",
    "MAX_INLINE_ROWS",
    "MAX_LENGTH_CHARS",
    "MAX_PATTERN_CHARS",
    "MAX_SEED",
    "MAX_STALENESS",
    "MAX_STEPS",
    "MAX_TEXT_CHARS",
    "MAX_TOKENS",
    "MAX_TOOLS",
    "METRIC_NAME_PATTERN",
    "PACKAGED_MODELS",
    "REGEX_MAX_MEM",
    "AdvantageScale",
    "ArithmeticGenerator",
    "AsyncSpec",
    "BestMode",
    "ChatMessage",
    "CheckpointSpec",
    "DatasetSpec",
    "DynamicSamplingSpec",
    "EnvironmentSpec",
    "EpisodeSpec",
    "EvalSpec",
    "ExactMatchGrader",
    "GRPOSpec",
    "GraderSpec",
    "GraderSpecBase",
    "GraderSpecUnion",
    "HttpEnvironment",
    "HttpToolImplementation",
    "InitFrom",
    "IntegrationSpec",
    "JobSpec",
    "KLEstimatorName",
    "KLPlacement",
    "KLSpec",
    "LengthGrader",
    "LoraSpec",
    "LossAggregation",
    "MathGrader",
    "MlflowIntegration",
    "MultiGrader",
    "NumericMatchGrader",
    "OverlongSpec",
    "PromptRow",
    "PythonEnvironment",
    "PythonGrader",
    "PythonToolImplementation",
    "RegexGrader",
    "ResourcesSpec",
    "RolloutEngineName",
    "RolloutSpec",
    "SamplerCorrectionMode",
    "SamplerCorrectionSpec",
    "SavedDataset",
    "ScoreModelGrader",
    "StrictModel",
    "StringCheckGrader",
    "TextSimilarityGrader",
    "ToolFunction",
    "ToolImplementation",
    "ToolSpec",
    "TrainingDtype",
    "UnresolvedMicroBatch",
    "WandbIntegration",
    "compile_regex",
    "grader_name",
    "is_hub_repo_id",
    "literal_tag",
    "rollout_dtype",
    "row_fields_problem",
    "spec_limits_violations",
    "text_problem",
]
