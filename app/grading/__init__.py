"""Grading: the request path (routes, service, repository, flags, stored grades) over the grader library
(`app.grading.graders`)."""
