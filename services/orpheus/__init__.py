"""Orpheus TTS: text (`text`), token layout (`tokens`), SNAC decoding (`snac`) and the engine (`engine`)."""
