"""/v1/graders: try a grader on a sample before a job spends a GPU on it.

- ``routes``: the ``/v1/graders`` routes;
- ``schemas``: their response bodies;
- ``service``: running a grader on one sample and one row, or only checking it.
"""
