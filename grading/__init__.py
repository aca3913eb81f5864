"""What scores a completion: the graders (each type's spec and runtime, one module each), the
bounded parsers of what tenants write in them (templates, formulas, RE2 patterns, Python
source), the sandbox that runs user Python, the operator's endpoints (the registry of judges,
tools and environments and the one bounded client that calls them), the judge's calls, and the
fair slots a process shares between projects. Torch-free: the API runs graders to validate and
preview them. It stands on ``specbase`` only; ``jobspec`` stands on it."""
