"""Chat templates of real model families, written into test models at test time (no hub access here).

QWEN3 is the template Qwen3's tokenizer_config.json ships (Apache-2.0): ChatML turns, tools in a system
block, assistant turns with <think> reasoning and <tool_call> JSON, tool results as <tool_response> in a
user turn, and `enable_thinking=false` writing an empty reasoning block into the generation prompt.

QWEN3_5 is written here in the format Qwen3.5's (and 3.6's, 3.8's) template renders: the same ChatML turns
and tool results, tools listed as JSON in a system block that asks for calls in XML-nested markup
(`<tool_call>`, `<function=NAME>`, `<parameter=ARG>` around each value: a string as written, any other
value as JSON), past turns' reasoning dropped before the last user query unless `preserve_thinking`, and
the generation prompt opening the reasoning (`<think>\n`) unless `enable_thinking=false` closes it empty,
and a content of parts rendered in order, an image part as `<|vision_start|><|image_pad|><|vision_end|>`.
"""

QWEN3 = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

QWEN3_5 = r"""
{%- macro render_content(content) %}
    {%- if content is string %}
        {{- content }}
    {%- elif content is not none %}
        {%- for item in content %}
            {%- if item.type == "image" or item.type == "image_url" or "image" in item %}
                {{- "<|vision_start|><|image_pad|><|vision_end|>" }}
            {%- elif item.type == "text" %}
                {{- item.text }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
{%- endmacro %}
{%- set ns = namespace(last_query=messages|length - 1) %}
{%- for message in messages %}
    {%- if message.role == "user" and message.content is not none and not render_content(message.content).startswith("<tool_response>") %}
        {%- set ns.last_query = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- set system = messages[0].content if messages and messages[0].role == "system" else "" %}
{%- if tools %}
    {{- "<|im_start|>system\n" }}
    {%- if system %}{{- system + "\n\n" }}{%- endif %}
    {{- "# Tools\n\nThese functions are available:\n\n<tools>" }}
    {%- for tool in tools %}{{- "\n" + (tool | tojson) }}{%- endfor %}
    {{- "\n</tools>\n\nTo call one, answer with:\n<tool_call>\n<function=NAME>\n<parameter=ARGUMENT>\nVALUE\n</parameter>\n</function>\n</tool_call>\nOne <parameter=...> per argument; several calls follow each other.<|im_end|>\n" }}
{%- elif system %}
    {{- "<|im_start|>system\n" + system + "<|im_end|>\n" }}
{%- endif %}
{%- for message in messages %}
    {%- set content = render_content(message.content) %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- "<|im_start|>" + message.role + "\n" + content + "<|im_end|>\n" }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning = message.reasoning_content if message.reasoning_content is string else "" %}
        {%- if "</think>" in content %}
            {%- set reasoning = content.split("</think>")[0].split("<think>")[-1].strip("\n") %}
            {%- set content = content.split("</think>")[-1].lstrip("\n") %}
        {%- endif %}
        {{- "<|im_start|>assistant\n" }}
        {%- if loop.index0 > ns.last_query or preserve_thinking is defined and preserve_thinking %}
            {{- "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" }}
        {%- endif %}
        {{- content }}
        {%- for call in message.tool_calls or [] %}
            {%- set call = call.function if call.function else call %}
            {%- if content or not loop.first %}{{- "\n" }}{%- endif %}
            {{- "<tool_call>\n<function=" + call.name + ">\n" }}
            {%- for name, value in (call.arguments or {}).items() %}
                {{- "<parameter=" + name + ">\n" + (value if value is string else value | tojson) + "\n</parameter>\n" }}
            {%- endfor %}
            {{- "</function>\n</tool_call>" }}
        {%- endfor %}
        {{- "<|im_end|>\n" }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or messages[loop.index0 - 1].role != "tool" %}{{- "<|im_start|>user" }}{%- endif %}
        {{- "\n<tool_response>\n" + content + "\n</tool_response>" }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{- "<|im_end|>\n" }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- "<|im_start|>assistant\n<think>\n" }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- "\n</think>\n\n" }}{%- endif %}
{%- endif %}
"""
