"""What scores a completion: the graders (each type's spec and runtime), the sandbox that runs
user Python, the judge client of operator endpoints, and the fair slots a process shares between
projects. Torch-free: the API runs graders to validate and preview them."""
