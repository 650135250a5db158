"""Small shared helpers: seeding, hashing, atomic files."""
