"""The recipe: the pydantic models every run is read from (model), the sections clouds add (section), and the JSON schema and Markdown reference generated from them (schema)."""
