"""The web dashboard's static files, served at `/`."""
