"""The web dashboard's static files, served at `/`.

- ``routes``: the page and its scripts (the repository's ``dashboard/`` folder) and the chart
  library, each served with a strict Content-Security-Policy.
"""
