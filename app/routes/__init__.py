"""HTTP routes: thin adapters from requests to services."""
