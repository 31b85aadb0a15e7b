"""Results database: SQLAlchemy models (``db.models``), engines and migrations (``db.session``),
the sweep driver's reads and writes (``db.store``)."""
