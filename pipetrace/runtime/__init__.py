"""Executes schedule plans on real ranks (torch backend; imports torch lazily)."""
