-- One /v1/models for the whole fleet, served by the HAProxy front itself (lua.fleet_models).
--
-- GET /v1/models asks every node's /v1/models (the servers of the `any_node` backend, which
-- deploy/multinode/haproxy.py fills with each node once) with the client's Authorization, and
-- answers the union in OpenAI's list shape: each model once, with `nodes`, what each node's
-- card says of it there ({name, state, wake_estimate_s}). A node that does not answer is listed
-- in `unanswered_nodes`, not an error; when none answers, a 503 in OpenAI's error shape.
-- GET /v1/models/{id}: that one model from the same union, or a 404 in OpenAI's shape.
--
-- The nodes' JSON is read with HAProxy's own json_query converter and strings are written with
-- its json converter: HAProxy's Lua has no JSON library. Each node gets ASK_TIMEOUT_MS; a node
-- HAProxy's checks already hold DOWN is not asked at all.

local ASK_TIMEOUT_MS = 2000
local MAX_MODELS = 1000 -- per node: bounds the json_query walk over `data`

local function fleet()
    local out = {}
    for name, server in pairs(core.backends["any_node"].servers) do
        out[#out + 1] = { name = name, server = server }
    end
    table.sort(out, function(a, b) return a.name < b.name end)
    return out
end

local function quoted(c, text)
    return '"' .. c:json(text, "utf8s") .. '"'
end

-- A whole number read exactly, or 0. Without json_query's "int" a JSON number comes back as %g text:
-- six significant digits, so a `created` of 1796155152 became 1796160000. With it, a string comes back
-- as it is: a card whose `created` is no integer (a string, or past int64) says 0 rather than failing
-- the whole list in string.format.
local function integer(c, body, path)
    local value = c:json_query(body, path, "int")
    if math.type(value) == "integer" then return value end
    return 0
end

local function error_body(c, message, kind, code)
    return '{"error": {"message": ' .. quoted(c, message) .. ', "type": "' .. kind .. '", "param": null, "code": "'
        .. code .. '"}}'
end

-- One node's answer: (cards, nil) or (nil, why it gave none, and its status and body when it refused).
local function ask(applet, node)
    local status = node.server:get_stats()["status"] or ""
    if status:sub(1, 4) == "DOWN" or status:sub(1, 5) == "MAINT" then
        return nil, "down in the front's health checks"
    end
    local headers = { ["Accept"] = { "application/json" } }
    local auth = applet.headers["authorization"]
    if auth and auth[0] then headers["Authorization"] = { auth[0] } end
    local ok, answer = pcall(function()
        return core.httpclient():get{ url = "http://" .. node.server:get_addr() .. "/v1/models", headers = headers,
                                      timeout = ASK_TIMEOUT_MS }
    end)
    if not ok or answer == nil or answer.status == nil or answer.status == 0 then
        return nil, "no answer within " .. ASK_TIMEOUT_MS .. " ms"
    end
    if answer.status ~= 200 then
        return nil, "answered " .. answer.status, answer.status, answer.body
    end
    local c, body, cards = applet.c, answer.body or "", {}
    for i = 0, MAX_MODELS - 1 do
        local card = "$.data[" .. i .. "]"
        local id = c:json_query(body, card .. ".id")
        if id == nil then break end
        cards[#cards + 1] = {
            id = id,
            created = integer(c, body, card .. ".created"),
            parent = c:json_query(body, card .. ".parent"),
            alias_of = c:json_query(body, card .. ".alias_of"),
            name = c:json_query(body, card .. ".node.name") or node.name,
            state = c:json_query(body, card .. ".state") or "unknown",
            wake = tonumber(c:json_query(body, card .. ".wake_estimate_s")) or 0,
        }
    end
    return cards
end

-- The union: {ids in order, by id}, the nodes that gave no list, and the first refusal (a bad key).
local function union(applet)
    local order, models, unanswered, refusal, answered = {}, {}, {}, nil, 0
    for _, node in ipairs(fleet()) do
        local cards, why, status, body = ask(applet, node)
        if cards == nil then
            unanswered[#unanswered + 1] = { name = node.name, why = why }
            if status and status >= 400 and status < 500 and refusal == nil then refusal = { status = status, body = body } end
        else
            answered = answered + 1
            for _, card in ipairs(cards) do
                local model = models[card.id]
                if model == nil then
                    model = { id = card.id, created = card.created, parent = card.parent, alias_of = card.alias_of, nodes = {} }
                    models[card.id] = model
                    order[#order + 1] = card.id
                end
                model.nodes[#model.nodes + 1] = card
            end
        end
    end
    table.sort(order)
    return order, models, unanswered, answered, refusal
end

local function model_json(c, model)
    local nodes = {}
    for _, card in ipairs(model.nodes) do
        nodes[#nodes + 1] = '{"name": ' .. quoted(c, card.name) .. ', "state": ' .. quoted(c, card.state)
            .. ', "wake_estimate_s": ' .. string.format("%g", card.wake) .. '}'
    end
    return '{"id": ' .. quoted(c, model.id) .. ', "object": "model", "created": ' .. string.format("%d", model.created)
        .. ', "owned_by": "hotswap", "parent": ' .. (model.parent and quoted(c, model.parent) or "null")
        .. ', "alias_of": ' .. (model.alias_of and quoted(c, model.alias_of) or "null")
        .. ', "nodes": [' .. table.concat(nodes, ", ") .. ']}'
end

local function reply(applet, status, body)
    applet:set_status(status)
    applet:add_header("Content-Type", "application/json")
    applet:add_header("Content-Length", string.len(body))
    if status == 503 then applet:add_header("Retry-After", "5") end
    applet:start_response()
    applet:send(body)
end

local function unescape(text)
    return (text:gsub("%%(%x%x)", function(hex) return string.char(tonumber(hex, 16)) end))
end

core.register_service("fleet_models", "http", function(applet)
    local c = applet.c
    local order, models, unanswered, answered, refusal = union(applet)
    if answered == 0 then
        if refusal then return reply(applet, refusal.status, refusal.body or "") end
        return reply(applet, 503, error_body(c, "no node of the fleet answered /v1/models", "service_unavailable",
                                             "no_node_available"))
    end
    local wanted = applet.path:match("^/v1/models/(.+)$")
    if wanted then
        local model = models[unescape(wanted)]
        if model == nil then
            return reply(applet, 404, error_body(c, "The model '" .. unescape(wanted) .. "' does not exist on any node.",
                                                 "not_found_error", "model_not_found"))
        end
        return reply(applet, 200, model_json(c, model))
    end
    local data, missing = {}, {}
    for _, id in ipairs(order) do data[#data + 1] = model_json(c, models[id]) end
    for _, node in ipairs(unanswered) do
        missing[#missing + 1] = '{"name": ' .. quoted(c, node.name) .. ', "why": ' .. quoted(c, node.why) .. '}'
    end
    reply(applet, 200, '{"object": "list", "data": [' .. table.concat(data, ", ") .. '], "unanswered_nodes": ['
        .. table.concat(missing, ", ") .. ']}')
end)
