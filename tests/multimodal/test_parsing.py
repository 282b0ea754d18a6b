"""Where images are in a request: OpenAI content parts and native markdown."""

import pytest

from loraplex.multimodal import InvalidMediaURL, split_chat_images, split_markdown_images


def test_chat_parts_become_image_markers_with_urls_in_order():
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare"},
                {"type": "image_url", "image_url": {"url": "https://a.test/1.png", "detail": "low"}},
                {"type": "text", "text": "with"},
                {"type": "image_url", "image_url": "https://a.test/2.png"},  # string shorthand
            ],
        },
        {"role": "assistant", "content": "They differ."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
    ]
    messages_out, urls = split_chat_images(messages)
    assert urls == ["https://a.test/1.png", "https://a.test/2.png", "data:image/png;base64,AAAA"]
    assert messages_out == [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare"},
                {"type": "image"},
                {"type": "text", "text": "with"},
                {"type": "image"},
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "They differ."}]},
        {"role": "user", "content": [{"type": "image"}]},
    ]
    # The caller's messages are not modified.
    assert messages[1]["content"][1]["type"] == "image_url"


def test_chat_parts_render_through_a_llava_style_template():
    """The output is what HF vision templates iterate: one <image> per image part, text kept."""
    from jinja2 import Template

    # The shape of llava-hf's template: images of a message first, then its text parts.
    template = Template(
        "{% for m in messages %}{{ m['role'].upper() }}: "
        "{% for c in m['content'] | selectattr('type', 'equalto', 'image') %}<image>\n{% endfor %}"
        "{% for c in m['content'] | selectattr('type', 'equalto', 'text') %}{{ c['text'] }}{% endfor %}\n{% endfor %}"
    )
    messages, urls = split_chat_images([
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://a.test/x.png"}},
            {"type": "text", "text": "What is this?"},
        ]},
    ])
    assert template.render(messages=messages) == "USER: <image>\nWhat is this?\n"
    assert urls == ["https://a.test/x.png"]


def test_chat_without_images_keeps_text():
    messages, urls = split_chat_images([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}])
    assert urls == []
    assert messages == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}, {"role": "assistant", "content": []}]


def test_chat_accepts_pydantic_like_parts():
    class Part:
        def model_dump(self, exclude_none=False):
            return {"type": "image_url", "image_url": {"url": "https://a.test/p.png"}}

    messages, urls = split_chat_images([{"role": "user", "content": [Part()]}])
    assert urls == ["https://a.test/p.png"] and messages[0]["content"] == [{"type": "image"}]


@pytest.mark.parametrize(
    "part, message",
    [
        ({"type": "input_audio", "input_audio": {}}, "messages[0].content[0]: content parts of type 'input_audio' are not supported"),
        ({"type": "image_url"}, "messages[0].content[0]: image_url must be an object"),
        ({"type": "image_url", "image_url": {"url": ""}}, "image_url.url must be a non-empty string"),
        ({"type": "image_url", "image_url": {"url": "https://a.test/x", "detail": "max"}}, "detail must be one of auto, low, high"),
        ({"type": "text", "text": 3}, "a text part needs a string 'text'"),
    ],
)
def test_chat_bad_parts_are_refused_by_location(part, message):
    with pytest.raises(InvalidMediaURL) as caught:
        split_chat_images([{"role": "user", "content": [part]}])
    assert caught.value.status == 400
    assert message in str(caught.value)


def test_markdown_images_become_placeholders_in_order():
    inputs = "Look: ![](https://a.test/1.png) then ![a cat](data:image/png;base64,iVBO+/=) and ![]( /srv/img/3.jpg ) end."
    text, urls = split_markdown_images(inputs, "<image>")
    assert urls == ["https://a.test/1.png", "data:image/png;base64,iVBO+/=", "/srv/img/3.jpg"]
    assert text == "Look: <image> then <image> and <image> end."


def test_markdown_placeholder_is_literal_and_plain_text_untouched():
    text, urls = split_markdown_images(r"[link](https://a.test) ![]() \1 ![](x)", r"<|image|>\1")
    assert urls == ["x"]
    assert text == r"[link](https://a.test) ![]() \1 <|image|>\1"


def test_markdown_is_linear_on_hostile_input():
    # Many unterminated openings: a backtracking pattern would take ages here.
    text, urls = split_markdown_images("![](" + "a" * 200_000 + " ![](" * 20_000, "<image>")
    assert urls == [] and text.startswith("![](aaa")
