"""The floor both the job spec (``jobspec``) and the graders (``grading``) stand on: the strict
model every spec section and every grader type's spec derives from (unknown fields refused,
finite floats, storable text) and the helpers of its validation. It imports nothing of the
project, so ``grading`` can declare its graders' specs without importing ``jobspec``, which
imports ``grading`` for its ``graders`` section.

- ``strict``: :class:`StrictModel` and the helpers of its validation.
"""

from specbase.strict import StrictModel, field_error, literal_tag, text_problem

__all__ = ["StrictModel", "field_error", "literal_tag", "text_problem"]
