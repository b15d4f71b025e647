"""The conversation's language: a turn switches it only when long and sure enough; a pinned one never moves."""

from services.languages import ConversationLanguage, word_count
from services.spoken_reply import SpokenReply

SEVEN = ("en", "es", "fr", "it", "pt", "zh", "ja")


def test_a_long_sure_turn_switches_the_language():
    language = ConversationLanguage(current="en", supported=SEVEN)
    assert language.decide([("es", 0.97), ("pt", 0.02)], "¿Cuál es la capital de Francia?") == "es"
    assert language.current == "es"
    assert language.decide([("fr", 0.99)], "Et quelle est la capitale de l'Italie ?") == "fr"


def test_a_short_or_unsure_turn_keeps_the_language():
    language = ConversationLanguage(current="es", supported=SEVEN)
    assert language.decide([("en", 0.9)], "OK.") == "es"  # one word
    assert language.decide([("it", 0.5), ("es", 0.45)], "Dimmi qualcosa di bello adesso") == "es"  # unsure
    assert language.current == "es"


def test_only_supported_languages_are_chosen():
    language = ConversationLanguage(current="en", supported=SEVEN)
    # Whisper's best guess is a language the agent has no voice for: the best supported one counts.
    assert language.decide([("gl", 0.6), ("es", 0.38)], "Onde está a estación de tren") == "en"
    assert language.decide([("de", 0.2), ("fr", 0.79)], "Où est la gare, s'il vous plaît ?") == "fr"


def test_a_pinned_language_never_moves():
    language = ConversationLanguage(current="fr", supported=SEVEN, pinned=True)
    assert language.decide([("es", 0.99)], "¿Cuál es la capital de Francia?") == "fr"


def test_words_are_counted_in_unspaced_scripts():
    assert word_count("法国的首都是哪里？") == 4
    assert word_count("フランスの首都はどこですか？") == 6.5
    assert word_count("What is it?") == 3


def test_a_reply_in_chinese_is_released_sentence_by_sentence():
    reply = SpokenReply(max_sentences=2)
    text = "巴黎是法国的首都。它很美。还有很多博物馆。"
    assert text[: reply.update(text)] == "巴黎是法国的首都。它很美。"
    assert reply.over
