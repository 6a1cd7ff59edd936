"""Callbacks that record and show: metrics and events files, console progress."""
