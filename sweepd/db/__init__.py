"""The database: tables, engines per dialect, and the migrations that make the tables."""
