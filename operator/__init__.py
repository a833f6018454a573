"""The kvgate operator: reconcile logic as pure functions (resources in, desired objects and statuses out)."""
