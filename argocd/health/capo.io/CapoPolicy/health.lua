-- Argo CD health of a capo.io CapoPolicy, from what capo's leader writes in its status:
-- observedGeneration and the Ready condition.
local hs = {}
if obj.status == nil or obj.status.conditions == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for capo to load the policy"
  return hs
end
local generation = obj.metadata.generation or 0
if obj.status.observedGeneration == nil or obj.status.observedGeneration < generation then
  hs.status = "Progressing"
  hs.message = "Waiting for capo to load generation " .. generation
  return hs
end
for _, condition in ipairs(obj.status.conditions) do
  if condition.type == "Ready" then
    if condition.status == "True" then
      hs.status = "Healthy"
      hs.message = condition.message or "Ready"
      return hs
    end
    if condition.status == "False" then
      hs.status = "Degraded"
      hs.message = (condition.reason or "NotReady") .. ": " .. (condition.message or "")
      return hs
    end
  end
end
hs.status = "Progressing"
hs.message = "Waiting for the Ready condition"
return hs
