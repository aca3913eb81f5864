"""/v1/graders: try a grader on a sample before a job spends a GPU on it."""
