"""What scores a completion: the graders (each type's spec and runtime, one module each), the
bounded parsers of what tenants write in them (templates, formulas, RE2 patterns, Python
source), the sandbox that runs user Python, the operator's endpoints (the registry of judges,
tools and environments and the one bounded client that calls them), the judge's calls, and the
fair slots a process shares between projects. Torch-free: the API runs graders to validate and
preview them. It stands on ``specbase`` only; ``jobspec`` stands on it.

- ``graders``: the grader types, each its spec and its runtime (one module each);
- ``templates``: the ``{{ sample.* }}`` / ``{{ item.* }}`` placeholders of grader settings;
- ``expressions``: the safe arithmetic of the ``multi`` grader's formula;
- ``regex``: the RE2 engine the graders' patterns run on, and how a pattern is compiled;
- ``python_source``: user Python source parsed within bounds;
- ``sandbox``: the bubblewrap sandbox that runs user Python;
- ``endpoints``: the operator's endpoints (judges, http tools and environments) and their client;
- ``judge``: the ``score_model`` grader's calls of its judge;
- ``fair_slots``: slots of a capacity one process shares fairly between projects.
"""
