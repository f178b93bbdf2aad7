"""Plugins: the manager that loads them (:mod:`.manager`), what each one offers
(:mod:`.records`), the conflicts between them (:mod:`.problems`), and raw platform payloads read
into events by the platform's plugin (:mod:`.events`)."""
