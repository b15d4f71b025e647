"""One module per way a user reaches a conversation: `livekit` (rooms), `webrtc` (peer to peer), `websocket` (/ws), `memory` (in-process)."""
