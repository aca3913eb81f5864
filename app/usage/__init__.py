"""/v1/usage: a project's checkpoint storage and its quota."""
